"""The peers: LiteLLM's proxy and Portkey's gateway, each in its own environment under .bench/.

LiteLLM runs twice: as a plain proxy (master key only), and configured to do Kiln's job as far
as it can here ("litellm-samejob"): a key of its own checked by `general_settings.custom_auth`,
`max_parallel_requests` 8 for that key through its parallel-request limiter, shared in Redis
(`general_settings.coordination_redis`; Debian's redis-server, installed with apt-get and
started by the bench), the model's per-token prices so that every answer carries its cost
(`x-litellm-response-cost`, `usage.cost`), and the Prometheus callback's spend counter. Its
database mode (virtual keys, stored spend, budgets: PostgreSQL through Prisma) is tried at
preparing time: `prisma generate` on LiteLLM's schema, which fetches Prisma's query engine at
run time; whatever it answers is recorded (`prisma_probe`).

Installed on the first run and reused (a marker file per install). Whatever happens to a
peer (install failed, would not start, crashed, answered errors) is recorded in its
`PeerStatus` and ends up in the JSON and the report; a peer is never silently dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .procs import Child, Procs, free_port, wait_http
from .stack import GAP_MODEL, MODEL, clean_env

__all__ = ["LITELLM_VERSIONS", "PeerStatus", "install_litellm", "install_portkey", "install_redis", "prisma_probe",
           "samejob_checks", "samejob_config", "start_litellm", "start_litellm_samejob", "start_portkey", "start_redis"]

ROOT = Path(__file__).resolve().parents[1]
# 1.106.12 first; 1.108.7 if it does not install. 1.110.2 does not resolve. Never 1.82.7/1.82.8
# (malicious releases), and never 1.107.0 (reported compromised).
LITELLM_VERSIONS = ("1.106.12", "1.108.7")
FORBIDDEN_LITELLM = {"1.82.7", "1.82.8", "1.107.0"}
PORTKEY_VERSION = "1.15.2"
PORTKEY_OVERRIDES = {"@hono/node-server": "1.13.5", "@hono/node-ws": "1.2.0"}
LITELLM_MASTER_KEY = "sk-bench-litellm-master"
SAMEJOB_KEY = "sk-bench-litellm-samejob-org-bench"
SAMEJOB_PARALLEL = 8
# the catalog's price of the bench model (USD per million tokens), as LiteLLM wants it: per token
SAMEJOB_PRICE_PER_MTOK = {"input": "0.035", "output": "0.07"}
CUSTOM_AUTH = '''"""Per-key auth for the bench's LiteLLM: the keys it knows, each with its parallel-request limit."""

import json
from pathlib import Path

from litellm.proxy._types import UserAPIKeyAuth

KEYS = json.loads((Path(__file__).parent / "keys.json").read_text())


async def user_api_key_auth(request, api_key: str) -> UserAPIKeyAuth:
    key = api_key.removeprefix("Bearer ").strip()
    entry = KEYS.get(key)
    if entry is None:
        raise Exception("invalid API key")
    return UserAPIKeyAuth(api_key=key, user_id=entry["org"], team_id=entry["org"],
                          max_parallel_requests=entry["max_parallel_requests"])
'''
MOCK_API_KEY = "sk-mock-upstream"


@dataclass
class PeerStatus:
    name: str
    version: str | None = None
    installed: bool = False
    install_log: str | None = None
    started: bool = False
    start_seconds: float | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    url: str | None = None
    pid: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _run(argv: list[str], log: Path, cwd: Path | None = None, timeout: float = 900) -> tuple[int, str]:
    with open(log, "ab") as out:
        out.write(f"\n=== {' '.join(argv)}\n".encode())
        out.flush()
        try:
            code = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL).returncode
        except (subprocess.TimeoutExpired, OSError) as exc:
            out.write(f"{type(exc).__name__}: {exc}\n".encode())
            code = -1
    return code, log.read_text(errors="replace")[-1500:]


# -- LiteLLM ------------------------------------------------------------------------------

def install_litellm(home: Path) -> PeerStatus:
    status = PeerStatus("litellm")
    uv = ROOT / ".venv" / "bin" / "uv"
    for version in LITELLM_VERSIONS:
        assert version not in FORBIDDEN_LITELLM
        where = home / f"litellm-{version}"
        venv = where / "venv"
        marker = where / ".installed"
        status.version = version
        if marker.exists():
            status.installed = True
            return status
        where.mkdir(parents=True, exist_ok=True)
        log = where / "install.log"
        print(f"bench: installing litellm[proxy]=={version} into {venv} (first run only)", flush=True)
        if not (venv / "bin" / "python").exists():
            code, tail = _run([sys.executable, "-m", "venv", str(venv)], log)
            if code != 0:
                status.problems.append(f"litellm {version}: venv failed: {tail}")
                continue
        if uv.exists():
            argv = [str(uv), "pip", "install", "--python", str(venv / "bin" / "python"), f"litellm[proxy]=={version}"]
        else:
            argv = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"litellm[proxy]=={version}"]
        code, tail = _run(argv, log)
        if code == 0 and (venv / "bin" / "litellm").exists():
            marker.write_text(version)
            status.installed = True
            return status
        status.problems.append(f"litellm[proxy]=={version} did not install (exit {code}): {tail[-600:]}")
    status.install_log = "; ".join(status.problems)
    return status


def _start(procs: Procs, status: PeerStatus, name: str, argv: list[str], *, env: dict[str, str], cwd: Path,
           port: int, health: str, timeout: float, ok: Callable[[int], bool] | None = None) -> Child | None:
    """Start a peer and wait for `health` to answer; on failure, say why in `status` and stop it."""
    started = time.monotonic()
    child = procs.start(name, argv, env=env, cwd=cwd)
    try:
        wait_http(f"http://127.0.0.1:{port}{health}", child=child, timeout=timeout, ok=ok)
    except (RuntimeError, TimeoutError) as exc:
        status.problems.append(f"did not start: {exc}")
        procs.stop(child)
        return None
    status.started, status.start_seconds = True, round(time.monotonic() - started, 2)
    status.url, status.pid = f"http://127.0.0.1:{port}/v1", child.pid
    return child


def start_litellm(procs: Procs, home: Path, status: PeerStatus, mock_url: str, gap_base: str) -> Child | None:
    if not status.installed:
        return None
    where = home / f"litellm-{status.version}"
    config = where / "config.yaml"
    models = [
        {"model_name": MODEL, "litellm_params": {"model": f"openai/{MODEL}", "api_base": f"{mock_url}/v1", "api_key": MOCK_API_KEY}},
        {"model_name": GAP_MODEL, "litellm_params": {"model": f"openai/{GAP_MODEL}", "api_base": gap_base, "api_key": MOCK_API_KEY}},
    ]
    # JSON is YAML: no yaml dependency needed here. Master key only: no database, no UI login.
    config.write_text(json.dumps({"model_list": models, "general_settings": {"master_key": LITELLM_MASTER_KEY}}, indent=1))
    port = free_port()
    env = clean_env(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False",
                    DISABLE_ADMIN_UI="True", PYTHONUNBUFFERED="1")
    argv = [str(where / "venv" / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num_workers", "1"]
    child = _start(procs, status, "litellm", argv, env=env, cwd=where, port=port, health="/health/liveliness",
                   timeout=180, ok=lambda s: s == 200)
    if child is None:
        return None
    status.notes.append("uvicorn, 1 worker, master key only (no database), LITELLM_LOCAL_MODEL_COST_MAP=True")
    return child


def litellm_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {LITELLM_MASTER_KEY}"}


def samejob_config(mock_url: str, redis_port: int) -> dict:
    """LiteLLM's config for the same job as Kiln's, as far as it runs without its database."""
    price = {f"{kind}_cost_per_token": float(value) / 1e6 for kind, value in SAMEJOB_PRICE_PER_MTOK.items()}
    return {
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"{mock_url}/v1", "api_key": MOCK_API_KEY,
            "input_cost_per_token": price["input_cost_per_token"], "output_cost_per_token": price["output_cost_per_token"]}}],
        "general_settings": {
            "master_key": LITELLM_MASTER_KEY,
            "custom_auth": "custom_auth.user_api_key_auth",
            "coordination_redis": {"host": "127.0.0.1", "port": redis_port},
        },
        "litellm_settings": {"callbacks": ["prometheus"]},
    }


SAMEJOB_EXTRAS = ("prometheus_client",)  # the Prometheus callback's own dependency, not in litellm[proxy]


def install_samejob_extras(home: Path, status: PeerStatus) -> str | None:
    """What the same-job configuration needs beyond litellm[proxy]; None when installed, else why not."""
    if not status.installed:
        return "LiteLLM is not installed"
    where = home / f"litellm-{status.version}"
    marker = where / ".samejob-extras"
    if marker.exists() and marker.read_text() == " ".join(SAMEJOB_EXTRAS):
        return None
    python = where / "venv" / "bin" / "python"
    uv = ROOT / ".venv" / "bin" / "uv"
    argv = ([str(uv), "pip", "install", "--python", str(python), *SAMEJOB_EXTRAS] if uv.exists()
            else [str(python), "-m", "pip", "install", "--quiet", *SAMEJOB_EXTRAS])
    code, tail = _run(argv, where / "install.log")
    if code != 0:
        return f"{' '.join(SAMEJOB_EXTRAS)} did not install (exit {code}): {tail[-400:]}"
    marker.write_text(" ".join(SAMEJOB_EXTRAS))
    return None


def start_litellm_samejob(procs: Procs, home: Path, status: PeerStatus, mock_url: str, redis_port: int) -> Child | None:
    if not status.installed:
        return None
    where = home / f"litellm-{status.version}" / "samejob"
    where.mkdir(parents=True, exist_ok=True)
    (where / "custom_auth.py").write_text(CUSTOM_AUTH)
    (where / "keys.json").write_text(json.dumps({SAMEJOB_KEY: {"org": "bench", "max_parallel_requests": SAMEJOB_PARALLEL}}))
    config = where / "config.yaml"
    config.write_text(json.dumps(samejob_config(mock_url, redis_port), indent=1))
    port = free_port()
    env = clean_env(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_TELEMETRY="False",
                    DISABLE_ADMIN_UI="True", PYTHONUNBUFFERED="1", PYTHONPATH=str(where))
    argv = [str(home / f"litellm-{status.version}" / "venv" / "bin" / "litellm"), "--config", str(config), "--host",
            "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    child = _start(procs, status, "litellm-samejob", argv, env=env, cwd=where, port=port, health="/health/liveliness",
                   timeout=180, ok=lambda s: s == 200)
    if child is None:
        return None
    status.notes.append(f"custom_auth (one key, max_parallel_requests {SAMEJOB_PARALLEL}), parallel-request limiter "
                        f"on Redis (coordination_redis, port {redis_port}), per-token prices "
                        f"${SAMEJOB_PRICE_PER_MTOK['input']}/${SAMEJOB_PRICE_PER_MTOK['output']} per million tokens, "
                        "callbacks: prometheus; no database")
    return child


def samejob_checks(base: str) -> dict:
    """That the same-job configuration does its job: an unknown key refused, the cost of a buffered
    answer in `x-litellm-response-cost`, and of a streamed one in its usage chunk."""
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}
    out: dict = {}
    with httpx.Client(timeout=60, trust_env=False) as client:
        wrong = client.post(f"{base}/chat/completions", json=body, headers={"authorization": "Bearer sk-not-a-key"})
        out["unknown_key_status"] = wrong.status_code
        buffered = client.post(f"{base}/chat/completions", json=body, headers=samejob_headers())
        out["buffered_status"] = buffered.status_code
        out["buffered_cost_header"] = buffered.headers.get("x-litellm-response-cost")
        streamed = client.post(f"{base}/chat/completions", headers=samejob_headers(),
                               json={**body, "stream": True, "stream_options": {"include_usage": True}})
        out["stream_status"] = streamed.status_code
        for line in streamed.text.splitlines():
            if line.startswith("data: {") and '"usage"' in line:
                try:
                    usage = json.loads(line[6:]).get("usage") or {}
                except ValueError:
                    continue
                if usage.get("cost") is not None:
                    out["stream_usage_cost"] = usage["cost"]
    return out


def samejob_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {SAMEJOB_KEY}"}


def prisma_probe(home: Path, status: PeerStatus) -> dict:
    """LiteLLM's database layer, tried: Prisma's Python client in a venv of its own, then `prisma
    generate` on LiteLLM's own schema (what `litellm` runs when given a database_url)."""
    if not status.installed:
        return {"ran": False, "why": "LiteLLM is not installed"}
    where = home / "prisma-probe"
    venv = where / "venv"
    log = where / "probe.log"
    where.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    uv = ROOT / ".venv" / "bin" / "uv"
    if not (venv / "bin" / "prisma").exists():
        code, tail = _run([sys.executable, "-m", "venv", str(venv)], log)
        argv = ([str(uv), "pip", "install", "--python", str(venv / "bin" / "python"), "prisma"] if uv.exists()
                else [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "prisma"])
        code, tail = _run(argv, log)
        if code != 0:
            return {"ran": True, "step": "pip install prisma", "exit": code, "output": tail[-800:]}
    schemas = sorted((home / f"litellm-{status.version}" / "venv").glob("lib/python3*/site-packages/litellm/proxy/schema.prisma"))
    if not schemas:
        return {"ran": False, "why": "LiteLLM's schema.prisma not found"}
    env = {**clean_env(), "PATH": f"{venv / 'bin'}:{clean_env().get('PATH', '/usr/bin:/bin')}"}
    started = time.monotonic()
    with open(log, "ab") as out:
        try:
            code = subprocess.run([str(venv / "bin" / "prisma"), "generate", "--schema", str(schemas[0])], cwd=where, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=180, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            code = -1
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("===")]
    return {"ran": True, "step": "prisma generate --schema litellm/proxy/schema.prisma", "exit": code,
            "seconds": round(time.monotonic() - started, 1), "output": "\n".join(lines[-6:])[-900:]}


# -- Redis (Debian's package) ----------------------------------------------------------------

def install_redis(home: Path) -> dict:
    """redis-server from Debian's package, with apt-get, if it is not on PATH yet."""
    found = shutil.which("redis-server")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        log = home / "apt-redis.log"
        print("bench: apt-get install redis-server (first run only)", flush=True)
        _run(["apt-get", "update", "-q"], log, timeout=600)
        code, tail = _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"], log, timeout=900)
        found = shutil.which("redis-server")
        if found is None:
            return {"error": f"apt-get install redis-server failed (exit {code}): {tail[-400:]}"}
    if found is None:
        return {"error": "redis-server not found and apt-get cannot run here (needs root)"}
    version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout.strip()
    return {"path": found, "version": version}


def start_redis(procs: Procs, redis: dict) -> tuple[Child, int] | None:
    if "path" not in redis:
        return None
    port = free_port()
    child = procs.start("redis", [redis["path"], "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--daemonize", "no"], env=clean_env())
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    return child, port
        except OSError:
            pass
        if not child.alive():
            return None
        time.sleep(0.05)
    return None


# -- Portkey ------------------------------------------------------------------------------

def install_portkey(home: Path) -> PeerStatus:
    status = PeerStatus("portkey", version=PORTKEY_VERSION)
    where = home / "portkey"
    marker = where / ".installed"
    package = {
        "name": "kiln-bench-portkey",
        "private": True,
        "dependencies": {"@portkey-ai/gateway": PORTKEY_VERSION},
        # Portkey's streaming fails on Node 20 with the current @hono/node-server
        "overrides": PORTKEY_OVERRIDES,
    }
    if marker.exists() and marker.read_text() == json.dumps(package):
        status.installed = True
        return status
    npm = shutil.which("npm")
    node = shutil.which("node")
    if not npm or not node:
        status.problems.append("node/npm not found on PATH")
        return status
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text(json.dumps(package, indent=2))
    print(f"bench: npm install @portkey-ai/gateway@{PORTKEY_VERSION} into {where} (first run only)", flush=True)
    code, tail = _run([npm, "install", "--no-audit", "--no-fund"], where / "install.log", cwd=where)
    server = where / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    if code != 0 or not server.exists():
        status.problems.append(f"npm install failed (exit {code}): {tail[-600:]}")
        return status
    marker.write_text(json.dumps(package))
    status.installed = True
    return status


def portkey_versions(home: Path) -> dict[str, str]:
    found = {}
    for name in ("@portkey-ai/gateway", *PORTKEY_OVERRIDES):
        try:
            found[name] = json.loads((home / "portkey" / "node_modules" / name / "package.json").read_text())["version"]
        except (OSError, ValueError, KeyError):
            found[name] = "?"
    return found


def start_portkey(procs: Procs, home: Path, status: PeerStatus) -> Child | None:
    if not status.installed:
        return None
    where = home / "portkey"
    port = free_port()
    server = where / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    env = clean_env(TRUSTED_CUSTOM_HOSTS="127.0.0.1,localhost", NODE_ENV="production")
    child = _start(procs, status, "portkey", [shutil.which("node") or "node", str(server), f"--port={port}", "--headless"],
                   env=env, cwd=where, port=port, health="/", timeout=60)
    if child is None:
        return None
    versions = portkey_versions(home)
    status.notes.append("node " + subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
                        + "; " + ", ".join(f"{k} {v}" for k, v in versions.items())
                        + "; listens on all interfaces (no host flag); traffic sent to 127.0.0.1 only")
    return child


def portkey_headers(upstream_base: str) -> dict[str, str]:
    return {
        "authorization": f"Bearer {MOCK_API_KEY}",
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": upstream_base,
    }
