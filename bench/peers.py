"""The peers: LiteLLM's proxy and Portkey's gateway, each in its own environment under .bench/.

Installed on the first run and reused (a marker file per install). Whatever happens to a
peer (install failed, would not start, crashed, answered errors) is recorded in its
`PeerStatus` and ends up in the JSON and the report; a peer is never silently dropped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .procs import Child, Procs, free_port, wait_http
from .stack import GAP_MODEL, MODEL, clean_env

__all__ = ["LITELLM_VERSIONS", "PeerStatus", "install_litellm", "install_portkey", "start_litellm", "start_portkey"]

ROOT = Path(__file__).resolve().parents[1]
# 1.106.12 first; 1.108.7 if it does not install. 1.110.2 does not resolve. Never 1.82.7/1.82.8
# (malicious releases), and never 1.107.0 (reported compromised).
LITELLM_VERSIONS = ("1.106.12", "1.108.7")
FORBIDDEN_LITELLM = {"1.82.7", "1.82.8", "1.107.0"}
PORTKEY_VERSION = "1.15.2"
PORTKEY_OVERRIDES = {"@hono/node-server": "1.13.5", "@hono/node-ws": "1.2.0"}
LITELLM_MASTER_KEY = "sk-bench-litellm-master"
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
