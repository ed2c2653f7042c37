"""`kiln dev`, as a user runs it: one command, exports, `ready`, a working stack, a clean exit."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kiln_ops.dev import read_exports


@pytest.fixture
def dev_stack(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    process = subprocess.Popen(  # port 0: the one the system gives, bound before anything starts
        [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0", "--mock-token-delay-ms", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    exports: dict[str, str] = {}
    lines = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("export "):
                name, _, value = line[len("export ") :].strip().partition("=")
                exports[name] = shlex.split(value)[0]
            if "ready" in line:
                break
        else:
            raise AssertionError("kiln dev printed no ready line within 60 s")
        assert "ready" in lines[-1], "".join(lines) + process.stderr.read()
        yield process, exports, tmp_path, lines[-1]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def _port_open(url: str) -> bool:
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, int(port))) == 0


def test_kiln_dev_serves_a_working_stack_and_prints_how_to_call_it(dev_stack):
    process, exports, cwd, ready = dev_stack
    # --port 0 was given: the port the system gave is the one printed, where the gateway serves
    port = int(exports["KILN_BASE_URL"].removeprefix("http://127.0.0.1:").removesuffix("/v1"))
    assert port > 0 and f"ready on http://127.0.0.1:{port}/v1 " in ready
    assert exports["KILN_API_KEY"].startswith("sk-kiln-")
    assert (Path(cwd) / ".kiln" / "dev.env").read_text().count("export ") == len(exports)

    client = openai.OpenAI(base_url=exports["KILN_BASE_URL"], api_key=exports["KILN_API_KEY"], max_retries=0)
    response = client.completions.create(model="gpt-oss-120b", prompt="The capital of France is", max_tokens=32)
    assert response.usage.model_extra["cost"] == pytest.approx(0.000000665)
    assert [m.id for m in client.models.list()] == ["qwen3-32b", "gpt-oss-120b"]

    # kiln admin reaches the same state from a shell that evaluated the exports
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}, **exports}
    shown = subprocess.run(
        [sys.executable, "-m", "kiln_ops.cli", "admin", "orgs", "show", "demo"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "concurrency  8" in shown.stdout and "credits      $9.999999335" in shown.stdout

    # the org manages itself (contract §10): its management key mints a limited key that works at once
    base, management = exports["KILN_BASE_URL"], {"Authorization": f"Bearer {exports['KILN_MANAGEMENT_KEY']}"}
    made = httpx.post(f"{base}/keys", json={"label": "agent", "spend_limit": "1", "spend_period": "day",
                                           "models": ["gpt-oss-120b"]}, headers=management, timeout=30)
    assert made.status_code == 201, made.text
    agent = openai.OpenAI(base_url=base, api_key=made.json()["secret"], max_retries=0)
    assert [m.id for m in agent.models.list()] == ["gpt-oss-120b"]
    agent.completions.create(model="gpt-oss-120b", prompt="The capital of France is", max_tokens=32)
    mine = httpx.get(f"{base}/key", headers={"Authorization": f"Bearer {made.json()['secret']}"}, timeout=30).json()
    assert (mine["label"], mine["spend"]) == ("agent", pytest.approx(0.000000665))
    credits = httpx.get(f"{base}/credits", headers=management, timeout=30).json()
    assert credits == {"object": "credits", "balance": pytest.approx(9.99999867), "currency": "USD"}

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=20) == 0
    time.sleep(0.5)
    assert not _port_open(exports["AWS_ENDPOINT_URL"])  # the embedded AWS went with it
    assert not _port_open(exports["KILN_UPSTREAM_URL"])  # and the mock model server
    # and its exports, which would lead a shell that sources them to a stack that is gone
    assert not (Path(cwd) / ".kiln" / "dev.env").exists()


def test_kiln_dev_against_an_existing_aws_endpoint_and_upstream(aws, mock, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0", "--aws-endpoint-url", aws.url,
         "--upstream-url", mock.url],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env,
    )
    try:
        exports = read_exports(process.stdout)
        mock.reset()
        response = httpx.post(
            f"{exports['KILN_BASE_URL']}/chat/completions",
            json={"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {exports['KILN_API_KEY']}"},
            timeout=30,
        )
        assert response.status_code == 200
        assert mock.stats["requests"] == 1  # served by the given upstream
        assert exports["AWS_ENDPOINT_URL"] == aws.url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=20)


def test_kiln_dev_on_a_port_already_taken_says_so_before_starting_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    with socket.socket() as holder:  # another server on the gateway's port (an earlier kiln dev, say)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "kiln_ops.cli", "dev", "--port", str(port)],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert done.returncode != 0
    assert f"127.0.0.1:{port} is already in use" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr
    assert "export " not in done.stdout and not (tmp_path / ".kiln" / "dev.env").exists()  # no exports that lead nowhere
    assert "kiln dev: created" not in done.stderr  # nothing provisioned, no emulator or mock started
    assert time.monotonic() - started < 15


def _kiln_dev(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0", *args],
                          capture_output=True, text=True, cwd=tmp_path, env={**base, **(env or {})}, timeout=60)


@pytest.mark.parametrize("args, env, said", [
    (["--aws-endpoint-url", "notaurl"], {}, "--aws-endpoint-url: not an http(s) URL"),
    (["--upstream-url", "notaurl"], {}, "--upstream-url: not an http(s) URL"),
    (["--port", "65536"], {}, "a port number must be 0-65535"),
    (["--port", "-1"], {}, "a port number must be 0-65535"),
    ([], {"KILN_LEASE_TTL_SECONDS": "abc"}, "KILN_LEASE_TTL_SECONDS"),
    ([], {"KILN_LEASE_RENEW_SECONDS": "100"}, "must be at most half of KILN_LEASE_TTL_SECONDS"),
])
def test_kiln_dev_refuses_a_bad_flag_or_setting_in_one_line_before_starting_anything(tmp_path, args, env, said):
    """Each gave a traceback, a setting's only after the embedded AWS and the mock had started."""
    done = _kiln_dev(tmp_path, *args, env=env)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "export " not in done.stdout and "kiln dev: created" not in done.stderr


def test_kiln_dev_against_an_aws_endpoint_that_does_not_answer_says_so_in_one_line(tmp_path):
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{unused.getsockname()[1]}"
    done = _kiln_dev(tmp_path, "--aws-endpoint-url", url)
    assert done.returncode == 1, done.stderr
    assert f"kiln dev: the AWS endpoint {url} could not be used" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "export " not in done.stdout


def test_kiln_dev_prints_an_ipv6_host_as_a_url_can_hold_it():
    from kiln_ops.dev import base_url

    assert base_url("::1", 8000) == base_url("[::1]", 8000) == "http://[::1]:8000/v1"
    assert base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/v1"
    assert base_url("localhost", 8000) == "http://localhost:8000/v1"


def test_the_stacks_children_go_when_kiln_dev_is_killed(tmp_path):
    """A `kiln dev` killed outright (SIGKILL, or a closed terminal's SIGHUP) left the embedded AWS
    and the mock running for ever, and the next `kiln dev` never noticed them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    for how in (signal.SIGKILL, signal.SIGHUP):
        process = subprocess.Popen([sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env)
        exports = read_exports(process.stdout)
        assert exports, "kiln dev did not start"
        process.send_signal(how)
        process.wait(timeout=15)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (_port_open(exports["AWS_ENDPOINT_URL"])
                                               or _port_open(exports["KILN_UPSTREAM_URL"])):
            time.sleep(0.1)
        assert not _port_open(exports["AWS_ENDPOINT_URL"]), how
        assert not _port_open(exports["KILN_UPSTREAM_URL"]), how


def test_a_second_stop_signal_while_the_children_stop_does_not_cut_the_clean_up_short(tmp_path):
    """Children slow to stop (here: each takes 2 s on SIGTERM), and a second SIGTERM meanwhile:
    it ended `kiln dev` in the middle of its clean-up, its exports file left behind."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, signal, time\n"
        "if b'emulator' in open('/proc/self/cmdline', 'rb').read() or "
        "b'mock-upstream' in open('/proc/self/cmdline', 'rb').read():\n"
        "    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2), os._exit(0)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "AWS_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-m", "kiln_ops.cli", "dev", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path, env=env)
    assert read_exports(process.stdout), "kiln dev did not start"
    assert (tmp_path / ".kiln" / "dev.env").exists()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the children are stopping
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert not (tmp_path / ".kiln" / "dev.env").exists()


def test_the_stacks_parts_serve_on_ports_no_other_process_can_take_first():
    """`kiln dev` chose its parts' ports by binding port 0 and letting it go, then started each
    part on its number: a port another process took in between (a client's outgoing connection,
    a parallel test's server) stopped `kiln dev` before it was ready, or led it to another
    process's emulator. Each part now serves on a socket bound before it starts, and held."""
    from kiln_ops.dev import _child, wait_until_up

    child, url = _child(["mock-upstream"])
    try:
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as rival, pytest.raises(OSError) as taken:
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            rival.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        wait_until_up(f"{url}/mock/stats", "mock model server", child)
        assert httpx.get(f"{url}/mock/stats", timeout=10).status_code == 200
    finally:
        child.terminate()
        child.wait(timeout=10)


@pytest.mark.parametrize("part", ["emulator", "mock-upstream"])
def test_a_part_of_the_stack_on_port_0_prints_the_port_it_serves_on(tmp_path, part):
    """`kiln emulator --port 0` (and the mock's) printed `http://127.0.0.1:0`, a URL that leads
    nowhere; it prints the port the system gave, and serves there."""
    process = subprocess.Popen([sys.executable, "-m", "kiln_ops.cli", part, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        said = process.stdout.readline()
        url = said.split(" on ", 1)[1].split()[0].removesuffix("/v1")
        assert not url.endswith(":0"), said
        deadline = time.monotonic() + 30
        while not _port_open(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/mock/stats" if part == "mock-upstream" else url, timeout=10).status_code < 500
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.parametrize("fd", ["0", "99"])
def test_a_part_of_the_stack_handed_no_listening_socket_says_so_in_one_line(tmp_path, fd):
    done = subprocess.run([sys.executable, "-m", "kiln_ops.cli", "emulator", "--fd", fd],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode != 0
    assert "kiln emulator: --fd" in done.stderr or "--fd: a file descriptor must be" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["unix socket", "abstract unix socket", "udp socket", "tcp socket not listening"])
def test_a_part_of_the_stack_handed_a_socket_it_cannot_serve_http_on_says_so_in_one_line(tmp_path, kind):
    """A listening Unix socket was taken for a TCP one: the emulator printed `http:///:path` and
    served there, or, for an abstract one, failed with a traceback."""
    if kind == "unix socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / "s"))
        sock.listen()
    elif kind == "abstract unix socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(b"\0kiln-test-" + str(os.getpid()).encode())
        sock.listen()
    elif kind == "udp socket":
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
    with sock:
        fd = sock.fileno()
        done = subprocess.run([sys.executable, "-m", "kiln_ops.cli", "emulator", "--fd", str(fd)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=60, pass_fds=(fd,))
    assert done.returncode != 0, done.stdout
    assert f"kiln emulator: --fd: file descriptor {fd} is no listening TCP socket" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "embedded AWS on" not in done.stdout, (done.stdout, done.stderr)
