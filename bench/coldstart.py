"""Cold start: process start → first answered request, each function started as the Lambda Web
Adapter starts it (its run.sh, AWS_LWA_PORT, LAMBDA_TASK_ROOT, the layer on PYTHONPATH, python3.13),
against a bare FastAPI hello-world app started the same way; with and without precompiled .pyc.

The deployed layer is built for aarch64 (its .so files do not load here), so an x86 copy is built
the way layers/gateway/Makefile builds it: `pip install -r requirements.txt --target` with
python3.13, the kiln package copied in, `compileall --invalidation-mode unchecked-hash`. The
functions are copied and precompiled as functions/Makefile does. "Without .pyc" is the same
tree with every __pycache__ removed and PYTHONDONTWRITEBYTECODE=1 (the interpreter's own
standard library keeps its .pyc in both: Lambda's runtime ships it precompiled too).

In production only chat/completions and completions take that path (template.yaml: `Handler:
run.sh` with the Web Adapter in streaming mode); models and generations are buffered Mangum
handlers in both modes (`Handler: app.handler`). Their production path is measured too: a
process that imports the function's module, as Lambda's Python runtime does at init, and calls
`handler(event, context)` with an API Gateway REST event, against a bare FastAPI app behind
Mangum started the same way; then a second invocation in the same process, as a warm
environment gets it.

The harness's own HTTP client is made before the clock starts, without a TLS context (every
URL is http://127.0.0.1): made inside the window, as before 2026-11-30T12:00Z, it added ~17 ms
to every start, the bare app's included.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from .procs import Procs, free_port
from .stack import MODEL, Stack

__all__ = ["build", "find_python313", "measure"]

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = {"chat_completions": "ChatCompletionsFunction", "completions": "CompletionsFunction",
             "models": "ModelsFunction", "generations": "GenerationsFunction"}
BARE_APP = '''"""A bare FastAPI hello-world app: the cold-start baseline."""

from fastapi import FastAPI

app = FastAPI()


@app.get("/healthz")
async def healthz():
    return {"status": "ok"}


@app.get("/")
async def hello():
    return {"hello": "world"}
'''
BARE_MANGUM_APP = BARE_APP.replace('"""A bare FastAPI hello-world app: the cold-start baseline."""', '"""A bare FastAPI hello-world app behind Mangum: the buffered cold-start baseline."""') + '''

from mangum import Mangum  # noqa: E402

handler = Mangum(app, lifespan="off")
'''
# What Lambda's Python runtime does for a buffered function, cut to the bone: import the handler's
# module (init), then invoke it twice with an API Gateway REST event; one JSON line on stdout.
MANGUM_RUNNER = r'''
import json, sys, time
t0 = time.perf_counter()
import app
t1 = time.perf_counter()
class Context:
    function_name = "bench"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:bench"
    memory_limit_in_mb = 1024
    aws_request_id = "bench-request"
    log_group_name = "/aws/lambda/bench"
    log_stream_name = "bench"
    def get_remaining_time_in_millis(self):
        return 29000
path, key = sys.argv[1], sys.argv[2]
headers = {"authorization": "Bearer " + key, "host": "bench.execute-api.us-east-1.amazonaws.com",
           "x-forwarded-proto": "https", "x-forwarded-port": "443", "accept": "application/json"}
event = {"resource": path, "path": path, "httpMethod": "GET", "headers": headers,
         "multiValueHeaders": {k: [v] for k, v in headers.items()}, "queryStringParameters": None,
         "multiValueQueryStringParameters": None, "pathParameters": None, "stageVariables": None,
         "requestContext": {"resourceId": "bench", "resourcePath": path, "httpMethod": "GET", "requestId": "bench-request",
                            "path": "/prod" + path, "accountId": "123456789012", "stage": "prod", "apiId": "bench",
                            "identity": {"sourceIp": "127.0.0.1", "userAgent": "bench"},
                            "domainName": "bench.execute-api.us-east-1.amazonaws.com"},
         "body": None, "isBase64Encoded": False}
first = app.handler(event, Context())
t2 = time.perf_counter()
second = app.handler(event, Context())
t3 = time.perf_counter()
print("BENCH-RESULT " + json.dumps({"import_ms": (t1 - t0) * 1000, "first_ms": (t2 - t1) * 1000, "second_ms": (t3 - t2) * 1000,
                  "status": first.get("statusCode"), "second_status": second.get("statusCode"),
                  "body": str(first.get("body"))[:300], "second_body": str(second.get("body"))[:300]}), flush=True)
'''
MANGUM_FUNCTIONS = ("models", "generations")


def find_python313() -> str | None:
    candidates = []
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=10).stdout.strip()
        candidates += sorted(glob.glob(f"{root}/versions/3.13*/bin/python3.13"))
    except (OSError, subprocess.SubprocessError):
        pass
    found = shutil.which("python3.13")
    if found:
        candidates.append(found)
    for candidate in candidates:
        try:
            ok = subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 13)"], timeout=20).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return candidate
    return None


def _compile(py313: str, path: Path) -> None:
    subprocess.run([py313, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash", str(path)],
                   check=True, stdout=subprocess.DEVNULL)


def build(work: Path, log: Callable[[str], None], *, source: Path = ROOT, deps_root: Path | None = None) -> dict[str, Any]:
    """The x86 layer + functions + bare app, precompiled (`pyc/`) and not (`nopyc/`), from `source`
    (this checkout, or another version's layers/ and functions/, extracted with git archive); the
    layer's dependencies are installed once per requirements file under `deps_root`."""
    py313 = find_python313()
    if py313 is None:
        return {"error": "python3.13 not found (pyenv install 3.13): cold start not measured"}
    requirements = (source / "layers" / "gateway" / "requirements.txt").read_bytes()
    digest = hashlib.sha256(requirements + py313.encode()).hexdigest()[:12]
    deps = (deps_root or work) / f"deps-{digest}"
    if not (deps / ".complete").exists():
        shutil.rmtree(deps, ignore_errors=True)
        log(f"  building the x86 layer's dependencies with {py313} (first run only)")
        code = subprocess.run([py313, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
                               "--only-binary=:all:", "--target", str(deps), "-r",
                               str(source / "layers" / "gateway" / "requirements.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if code.returncode != 0:
            return {"error": f"pip install of the layer's requirements failed: {code.stderr[-800:]}"}
        (deps / ".complete").write_text(digest)
    work.mkdir(parents=True, exist_ok=True)
    pyc = work / "pyc"
    shutil.rmtree(pyc, ignore_errors=True)
    layer = pyc / "layer" / "python"
    shutil.copytree(deps, layer, ignore=shutil.ignore_patterns("__pycache__", ".complete"))
    shutil.copytree(source / "layers" / "gateway" / "kiln", layer / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    for function in FUNCTIONS:
        target = pyc / "functions" / function
        target.mkdir(parents=True)
        shutil.copy(source / "functions" / function / "app.py", target / "app.py")
        shutil.copy(source / "functions" / "run.sh", target / "run.sh")
    bare = pyc / "functions" / "bare_fastapi"
    bare.mkdir(parents=True)
    (bare / "app.py").write_text(BARE_APP)
    shutil.copy(source / "functions" / "run.sh", bare / "run.sh")
    (pyc / "functions" / "bare_mangum").mkdir(parents=True)
    (pyc / "functions" / "bare_mangum" / "app.py").write_text(BARE_MANGUM_APP)
    started = time.monotonic()
    _compile(py313, pyc)
    compile_s = time.monotonic() - started
    nopyc = work / "nopyc"
    shutil.rmtree(nopyc, ignore_errors=True)
    shutil.copytree(pyc, nopyc, ignore=shutil.ignore_patterns("__pycache__"))
    version = subprocess.run([py313, "--version"], capture_output=True, text=True).stdout.strip()
    return {"python": py313, "python_version": version, "pyc": str(pyc), "nopyc": str(nopyc),
            "compile_seconds": round(compile_s, 1), "layer_digest": digest}


def _client() -> httpx.Client:
    """The harness's client: plain http to 127.0.0.1 only, so no TLS context (httpx builds one with
    the certifi bundle by default: ~17 ms here, which must not count as the function's start)."""
    return httpx.Client(timeout=60, trust_env=False, verify=False)


def _first_request(app: str, url: str, key: str, gen_id: str | None, client: httpx.Client | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    with _client() if client is None else _Borrowed(client) as client:
        if app == "chat_completions":
            return client.post(f"{url}/v1/chat/completions", headers=headers, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16})
        if app == "completions":
            return client.post(f"{url}/v1/completions", headers=headers, json={
                "model": MODEL, "prompt": "The capital of France is", "max_tokens": 16})
        if app == "models":
            return client.get(f"{url}/v1/models", headers=headers)
        if app == "generations":
            return client.get(f"{url}/v1/generations/{gen_id}", headers=headers)
        return client.get(f"{url}/")


class _Borrowed:
    """A client used in a `with` block without closing it."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def __enter__(self) -> httpx.Client:
        return self.client

    def __exit__(self, *exc: object) -> None:
        return None


def _start_once(procs: Procs, stack: Stack, built: dict, variant: str, app: str, *, gen_id: str | None,
                importtime: bool = False) -> dict[str, Any]:
    tree = Path(built[variant])
    task_root = tree / "functions" / app
    port = free_port()
    extra = {"PYTHONDONTWRITEBYTECODE": "1"}
    if importtime:
        extra["PYTHONPROFILEIMPORTTIME"] = "1"
    env = stack.function_env(port, task_root, python_dir=str(Path(built["python"]).parent),
                             pythonpath=str(tree / "layer" / "python"), **extra)
    url = f"http://127.0.0.1:{port}"
    name = f"cold-{app}-{variant}" + ("-importtime" if importtime else "")
    client = _client()  # made before the clock starts
    started = time.perf_counter()
    child = procs.start(name, ["sh", str(task_root / "run.sh")], env=env, cwd=task_root)
    ready = None
    try:
        deadline = started + 60
        while ready is None:
            if not child.alive():
                return {"error": child.describe_death()}
            try:
                if client.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                    ready = time.perf_counter()
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                return {"error": "not ready within 60 s"}
            time.sleep(0.01)  # the Web Adapter's readiness check interval
        response = _first_request(app, url, stack.key, gen_id, client)
        done = time.perf_counter()
        result = {
            "ready_ms": round((ready - started) * 1000, 1),
            "first_answer_ms": round((done - started) * 1000, 1),
            "status": response.status_code,
            "gen_id": response.headers.get("x-neocloud-generation-id"),
        }
        if response.status_code != 200:
            result["error"] = f"HTTP {response.status_code}: {response.text[:300]}"
        return result
    finally:
        client.close()
        procs.stop(child)
        if importtime:
            result_log = child.log_path.read_text(errors="replace")
            _IMPORTTIME[(app, variant)] = _parse_importtime(result_log)
            _IMPORTED[(app, variant)] = _self_times(result_log)


def _mangum_path(app: str, gen_id: str | None) -> str:
    return {"models": "/v1/models", "generations": f"/v1/generations/{gen_id}"}.get(app, "/")


def _start_mangum_once(stack: Stack, built: dict, variant: str, app: str, *, gen_id: str | None) -> dict[str, Any]:
    """One buffered cold start: process start → the handler's first answer (Lambda's init + first invoke)."""
    import json

    tree = Path(built[variant])
    folder = "bare_mangum" if app == "bare_fastapi" else app
    task_root = tree / "functions" / folder
    env = stack.function_env(free_port(), task_root, python_dir=str(Path(built["python"]).parent),
                             pythonpath=f"{tree / 'layer' / 'python'}:{task_root}", PYTHONDONTWRITEBYTECODE="1")
    for name in ("AWS_LWA_PORT",):
        env.pop(name, None)
    argv = [built["python"], "-c", MANGUM_RUNNER, _mangum_path(app, gen_id), stack.key]
    started = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=task_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for raw in child.stdout:  # the function's own log lines (Powertools writes to stdout) come first
            if raw.startswith("BENCH-RESULT "):
                line = raw[len("BENCH-RESULT "):]
                break
        answered = time.perf_counter()
        _, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        return {"error": "no answer within 60 s"}
    if not line:
        return {"error": f"exit {child.returncode}: {err[-600:]}"}
    out = json.loads(line)
    result = {"ready_ms": round(out["import_ms"], 1), "first_answer_ms": round((answered - started) * 1000, 1),
              "handler_first_ms": round(out["first_ms"], 1), "second_invoke_ms": round(out["second_ms"], 1),
              "status": out["status"], "second_status": out["second_status"]}
    if out["status"] != 200:
        result["error"] = f"HTTP {out['status']}: {out['body']}"
    elif out["second_status"] != 200:
        result["second_error"] = f"HTTP {out['second_status']}: {out['second_body']}"
    return result


_IMPORTTIME: dict[tuple[str, str], list[dict[str, Any]]] = {}
_IMPORTED: dict[tuple[str, str], dict[str, int]] = {}


def _self_times(text: str) -> dict[str, int]:
    """Every module the last run in a log imported, with its own (self) import time in µs."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("=== ")]
    out: dict[str, int] = {}
    for line in lines[starts[-1] if starts else 0:]:
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) == 3 and parts[0].strip().isdigit():
            out[parts[2].strip()] = out.get(parts[2].strip(), 0) + int(parts[0].strip())
    return out


def imports_beyond_bare(app: str, top: int = 14) -> dict[str, Any]:
    """What `app` imports that the bare app does not, by package (kiln by module), self time summed
    (under -X importtime, which itself slows imports down)."""
    mine, bare = _IMPORTED.get((app, "pyc")), _IMPORTED.get(("bare_fastapi", "pyc"))
    if not mine or not bare:
        return {}
    groups: dict[str, int] = {}
    for name, self_us in mine.items():
        if name in bare:
            continue
        parts = name.split(".")
        group = ".".join(parts[:2]) if parts[0] == "kiln" else parts[0]
        groups[group] = groups.get(group, 0) + self_us
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"total_ms": round(sum(groups.values()) / 1000, 1), "app_total_ms": round(sum(mine.values()) / 1000, 1),
            "bare_total_ms": round(sum(bare.values()) / 1000, 1),
            "by_package": [{"package": k, "self_ms": round(v / 1000, 1)} for k, v in ranked[:top]],
            "rest_ms": round(sum(v for _, v in ranked[top:]) / 1000, 1)}


def _parse_importtime(text: str, top: int = 15) -> list[dict[str, Any]]:
    """The slowest top-level imports (cumulative µs) of the last run in a log (Procs appends every
    start of the same name to one log, each after a `=== ` line)."""
    rows = []
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("=== ")]
    for line in lines[starts[-1] if starts else 0:]:
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line[len("import time:"):].split("|")
        if len(parts) != 3:
            continue
        self_us, cumulative, name = parts
        try:
            int(self_us.strip()), int(cumulative.strip())
        except ValueError:
            continue
        depth = len(name) - len(name.lstrip(" "))
        rows.append((depth, name.strip(), int(cumulative.strip()), int(self_us.strip())))
    if not rows:
        return []
    shallow = min(depth for depth, *_ in rows)
    tops = [r for r in rows if r[0] == shallow]
    tops.sort(key=lambda r: -r[2])
    return [{"module": name, "cumulative_ms": round(cum / 1000, 1), "self_ms": round(own / 1000, 1)}
            for _, name, cum, own in tops[:top]]


PYINSTRUMENT_TARGET = ROOT / ".bench" / "tools" / "py313"


def install_pyinstrument(py313: str) -> bool:
    """pyinstrument for python3.13, in the bench's tool area (never the layer, never the project venv)."""
    if (PYINSTRUMENT_TARGET / "pyinstrument").exists():
        return True
    done = subprocess.run([py313, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target",
                           str(PYINSTRUMENT_TARGET), "pyinstrument"], capture_output=True)
    return done.returncode == 0


def profile_first_request(procs: Procs, stack: Stack, built: dict, app: str = "chat_completions") -> dict[str, Any]:
    """pyinstrument over one start of a function (imports, readiness, the first request), .pyc variant.

    The command is run.sh's own uvicorn line with `-m pyinstrument` in front; the process is
    stopped with SIGINT, uvicorn exits cleanly and pyinstrument writes its report.
    """
    if not (PYINSTRUMENT_TARGET / "pyinstrument").exists():
        return {"error": "pyinstrument for python3.13 is not installed in .bench/tools/py313"}
    tree = Path(built["pyc"])
    task_root = tree / "functions" / app
    port = free_port()
    out = ROOT / ".bench" / "profiles" / f"coldstart-{app}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    env = stack.function_env(port, task_root, python_dir=str(Path(built["python"]).parent),
                             pythonpath=f"{tree / 'layer' / 'python'}:{task_root}:{PYINSTRUMENT_TARGET}",
                             PYTHONDONTWRITEBYTECODE="1")
    argv = [built["python"], "-m", "pyinstrument", "--interval", "0.0005", "-r", "text", "--show", "*kiln*", "-o", str(out),
            "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning",
            "--timeout-keep-alive", "75", "--no-proxy-headers", "app:app"]
    child = procs.start(f"cold-{app}-pyinstrument", argv, env=env, cwd=task_root)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            for _ in range(3000):
                try:
                    if client.get(f"{url}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.01)
        response = _first_request(app, url, stack.key, None)
    finally:
        # SIGINT: uvicorn shuts down, re-raises it as KeyboardInterrupt, pyinstrument writes its report
        # (on SIGTERM uvicorn re-raises SIGTERM and the process dies before the report is written)
        try:
            os.killpg(child.pid, 2)
            child.popen.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        procs.stop(child, timeout=15)
    if not out.exists():
        return {"error": "pyinstrument wrote no report", "log": child.log_tail(800)}
    return {"status": response.status_code, "report_file": str(out), "report": condense_pyinstrument(out.read_text(errors="replace"))}


def condense_pyinstrument(text: str, *, min_s: float = 0.012, depth: int = 9) -> str:
    """pyinstrument's text tree without the deep library frames: the shallow ones and kiln's, ≥ min_s."""
    import re

    kept = []
    for line in text.splitlines():
        match = re.match(r"^([\s│├└─]*)(\d+\.\d+) (.*)$", line)
        if not match:
            continue
        level = len(match.group(1)) // 3
        seconds, what = float(match.group(2)), match.group(3)
        if seconds < min_s or "pydantic/" in what or "click/" in what:
            continue
        if level <= depth or "kiln/" in what or "app.py" in what:
            kept.append(f"{'  ' * min(level, 20)}{seconds * 1000:6.0f} ms  {what[:110]}")
    return "\n".join(kept)


def _summarize(runs: dict[str, dict[str, list[dict]]], bare_runs: dict[str, list[dict]] | None = None) -> dict[str, Any]:
    """Medians per variant and app; ratios to the bare app's first answer (`bare_runs`: the bare
    app's starts in the same run, when `runs` has none of its own)."""
    out: dict[str, Any] = {}
    for variant, per_app in runs.items():
        out[variant] = {}
        apps = dict(per_app)
        if "bare_fastapi" not in apps and bare_runs is not None:
            apps["bare_fastapi"] = bare_runs[variant]["bare_fastapi"]
        for app, results in apps.items():
            good = [r for r in results if "error" not in r]
            out[variant][app] = {
                "runs": len(results),
                "errors": [r["error"][:300] for r in results if "error" in r],
                "ready_ms_median": round(statistics.median(r["ready_ms"] for r in good), 1) if good else None,
                "first_answer_ms_median": round(statistics.median(r["first_answer_ms"] for r in good), 1) if good else None,
                "first_answer_ms_all": [r["first_answer_ms"] for r in good],
                "first_request_ms_median": round(statistics.median(r["first_answer_ms"] - r["ready_ms"] for r in good), 1)
                if good else None,
            }
        bare = out[variant]["bare_fastapi"]["first_answer_ms_median"]
        for app in FUNCTIONS:
            if app not in out[variant]:
                continue
            entry = out[variant][app]
            entry["ratio_to_bare"] = round(entry["first_answer_ms_median"] / bare, 3) \
                if bare and entry["first_answer_ms_median"] else None
    return out


def production_paths(summary: dict[str, Any]) -> dict[str, Any]:
    """Each function on the path it takes in production (template.yaml): chat/completions and
    completions through run.sh + uvicorn (the Web Adapter's), models and generations through Mangum;
    each against the bare FastAPI app on the same path, in the same run."""
    out: dict[str, Any] = {}
    for variant in ("pyc", "nopyc"):
        out[variant] = {}
        for app in FUNCTIONS:
            path = "mangum" if app in MANGUM_FUNCTIONS else "variants"
            per_app = (summary.get(path) or {}).get(variant) or {}
            entry, bare = per_app.get(app) or {}, per_app.get("bare_fastapi") or {}
            out[variant][app] = {"path": "Mangum handler" if path == "mangum" else "run.sh + uvicorn (Web Adapter)",
                                 "first_answer_ms": entry.get("first_answer_ms_median"),
                                 "bare_ms": bare.get("first_answer_ms_median"), "ratio_to_bare": entry.get("ratio_to_bare"),
                                 "errors": entry.get("errors") or []}
    return out


def measure(procs: Procs, stack: Stack, built: dict, *, repeats: int, log: Callable[[str], None],
            versions: dict[str, dict] | None = None, label: str = "this tree") -> dict[str, Any]:
    """Every function and the bare app, with and without .pyc, `repeats` starts each. `versions`:
    other versions' builds (older commits), started interleaved with this tree's — the same app
    and variant of every version back to back — so that the machine's drift hits them alike; their
    ratios are to the bare app of the same run."""
    if "error" in built:
        return {"error": built["error"]}
    versions = versions or {}
    apps = [*FUNCTIONS, "bare_fastapi"]
    runs: dict[str, dict[str, list[dict]]] = {variant: {app: [] for app in apps} for variant in ("pyc", "nopyc")}
    mangum_apps = [*MANGUM_FUNCTIONS, "bare_fastapi"]
    mangum: dict[str, dict[str, list[dict]]] = {variant: {app: [] for app in mangum_apps} for variant in ("pyc", "nopyc")}
    older: dict[str, dict[str, dict[str, list[dict]]]] = {
        v: {variant: {app: [] for app in FUNCTIONS} for variant in ("pyc", "nopyc")} for v in versions}
    # One start per variant that is not counted: the first start after the build pays for cold
    # file caches. It also makes the generation the generations app's first request reads.
    gen_id = None
    for variant in ("pyc", "nopyc"):
        gen_id = _start_once(procs, stack, built, variant, "chat_completions", gen_id=None).get("gen_id") or gen_id
    for repeat in range(repeats):
        # Every app takes every place in the sequence in turn: whichever starts first after the other
        # variant's tree is measurably slower (~10-30 ms here), and that must not always be the same app.
        turn = repeat % len(apps)
        for variant in (("pyc", "nopyc") if repeat % 2 == 0 else ("nopyc", "pyc")):
            for app in apps[turn:] + apps[:turn]:
                order = [(label, built)] + ([] if app == "bare_fastapi" else list(versions.items()))
                if repeat % 2:
                    order.reverse()
                for name, tree in order:
                    result = _start_once(procs, stack, tree, variant, app, gen_id=gen_id)
                    if app == "chat_completions" and name == label and result.get("gen_id"):
                        gen_id = result["gen_id"]
                    (runs if name == label else older[name])[variant][app].append(result)
            # the buffered functions' production path (Mangum), this tree only
            for app in mangum_apps[turn % len(mangum_apps):] + mangum_apps[:turn % len(mangum_apps)]:
                mangum[variant][app].append(_start_mangum_once(stack, built, variant, app, gen_id=gen_id))
    # one more start per function with -X importtime (not counted in the figures)
    for app in apps:
        _start_once(procs, stack, built, "pyc", app, gen_id=gen_id, importtime=True)
    summary: dict[str, Any] = {"repeats": repeats, "python": built.get("python_version"), "label": label,
                               "order": "rotated",
                               "variants": _summarize(runs)}
    summary["mangum"] = _summarize(mangum)
    for variant in ("pyc", "nopyc"):
        for app in mangum_apps:
            entry = summary["mangum"][variant][app]
            seconds = [r.get("second_invoke_ms") for r in mangum[variant][app] if r.get("second_invoke_ms") is not None]
            entry["second_invoke_ms_median"] = round(statistics.median(seconds), 1) if seconds else None
            entry["second_invoke_errors"] = [r["second_error"][:300] for r in mangum[variant][app] if "second_error" in r]
    summary["production"] = production_paths(summary)
    for variant in ("pyc", "nopyc"):
        log(f"  {variant}: " + ", ".join(
            f"{app} {summary['variants'][variant][app]['first_answer_ms_median']} ms" for app in apps))
        log(f"  {variant}, Mangum: " + ", ".join(
            f"{app} {summary['mangum'][variant][app]['first_answer_ms_median']} ms" for app in mangum_apps))
    if versions:
        summary["versions"] = {}
        for name in versions:
            summary["versions"][name] = {"variants": _summarize(older[name], runs)}
            for variant in ("pyc", "nopyc"):
                log(f"  at {name}, {variant}: " + ", ".join(
                    f"{app} {summary['versions'][name]['variants'][variant][app]['first_answer_ms_median']} ms "
                    f"(×{summary['versions'][name]['variants'][variant][app].get('ratio_to_bare')})" for app in FUNCTIONS))
    summary["importtime_top"] = {f"{app}": _IMPORTTIME.get((app, "pyc"), []) for app in apps}
    summary["imports_beyond_bare"] = {app: imports_beyond_bare(app) for app in FUNCTIONS}
    if install_pyinstrument(built["python"]):
        summary["first_request_profile"] = profile_first_request(procs, stack, built)
    else:
        summary["first_request_profile"] = {"error": "could not install pyinstrument for python3.13"}
    return summary
