"""`kiln dev`: the whole stack on this machine, in one process tree, with no AWS account.

    embedded AWS (serialized moto)  ─ child process, unless --aws-endpoint-url is given
                                      (--faults or KILN_EMULATOR_FAULTS: its DynamoDB fault mode)
    mock model server               ─ child process, unless --upstream-url is given
    the gateway (all endpoints)     ─ this process, uvicorn

It creates what is missing (tables and parameters from template.yaml, the catalog from
infra/catalog.json pointed at the model server), a demo org with a fresh key, then prints
`export NAME=value` lines (also written to .kiln/dev.env) and a line containing `ready`.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx

from kiln.catalog import Catalog

__all__ = ["base_url", "local_catalog", "read_exports", "run_dev", "wait_until_up"]

DEMO_ORG = "demo"
DEMO_CREDITS = Decimal("10")
DEMO_CONCURRENCY = 8
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


def _child(args: list[str]) -> tuple[subprocess.Popen, str]:
    """A part of the stack (`kiln emulator`, `kiln mock-upstream`) started on a loopback socket
    bound here and handed to it: no other process can take its port between the choice and the
    serving, as one could a port found free and let go. The child, and its URL."""
    from .serve import listening_socket, served_url

    with listening_socket("127.0.0.1", 0) as sock:
        # a child goes with its parent, even one killed outright (SIGKILL): none is left running
        # for ever, holding its port, unseen by the next `kiln dev`
        child = subprocess.Popen([sys.executable, "-m", "kiln_ops.cli", *args, "--fd", str(sock.fileno())],
                                 start_new_session=False, pass_fds=(sock.fileno(),),
                                 preexec_fn=_stopping_with(os.getpid()))
        return child, served_url(sock)


def _stopping_with(parent: int) -> Callable[[], None] | None:
    """What the child runs before it starts: SIGTERM for it when `parent` ends (Linux's
    PR_SET_PDEATHSIG, looked up here, not between fork and exec); None where there is none
    (the parent's own handlers still stop its children)."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    set_parent_death_signal = 1

    def stop_with_the_parent() -> None:
        prctl(set_parent_death_signal, signal.SIGTERM)
        if os.getppid() != parent:  # the parent ended before the signal was asked for
            os._exit(1)

    return stop_with_the_parent


def wait_until_up(url: str, what: str, child: subprocess.Popen | None, timeout: float = 30.0, who: str = "kiln dev") -> None:
    """Wait until `url` answers anything over HTTP; fail clearly if `child` dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            raise SystemExit(f"{who}: the {what} exited with status {child.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{who}: the {what} did not answer at {url} within {timeout:.0f}s")


def read_exports(lines: Iterable[str]) -> dict[str, str]:
    """The `export NAME=value` lines `kiln dev` prints, read up to its `ready` line (for scripts
    that start it); empty if it stopped before saying ready."""
    exports: dict[str, str] = {}
    for line in lines:
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            exports[name] = shlex.split(value)[0]
        if "ready" in line:
            return exports
    return {}


def run_dev(
    *,
    host: str,
    port: int,
    upstream_url: str | None,
    mock_token_delay_ms: float,
    aws_endpoint_url: str | None,
    faults: Any = None,
) -> int:
    from botocore.exceptions import BotoCoreError, ClientError
    from pynamodb.exceptions import PynamoDBException

    from kiln.settings import Settings, SettingsError

    from .provision import aws_clients, provision
    from .serve import listen_as, serve
    from .template import repo_root

    try:  # a bad setting is said before anything starts
        Settings.from_env()
    except SettingsError as exc:
        print(f"kiln dev: {exc}", file=sys.stderr)
        return 2

    children: list[subprocess.Popen] = []
    sock: socket.socket | None = None  # the gateway's, bound first
    written: str | None = None  # the exports in .kiln/dev.env, removed on the way out
    # stop the children on the way out, the terminal closed (SIGHUP) included
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))

    def stop_children(*_: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()

    try:
        if faults is not None and aws_endpoint_url is not None:
            raise SystemExit("kiln dev: --faults applies to the embedded AWS, not to --aws-endpoint-url")
        # bound before anything starts, and held: no exports that would lead nowhere, no stack left
        # half up, and no other process can take the port while the stack starts (0: any port)
        sock = listen_as("kiln dev", host, port)
        port = sock.getsockname()[1]
        if aws_endpoint_url is None:
            fault_args = ["--faults", faults.describe()] if faults is not None and faults.enabled else []
            child, aws_endpoint_url = _child(["emulator", *fault_args])
            children.append(child)
            wait_until_up(aws_endpoint_url, "embedded AWS", child)
        if upstream_url is None:
            child, mock_url = _child(["mock-upstream", "--token-delay-ms", str(mock_token_delay_ms)])
            children.append(child)
            upstream_url = f"{mock_url}/v1"
            wait_until_up(f"{mock_url}/mock/stats", "mock model server", child)

        os.environ.update({key: os.environ.get(key, value) for key, value in FAKE_CREDENTIALS.items()})
        # request logs on the console; EMF metrics only mean something in CloudWatch
        os.environ.setdefault("POWERTOOLS_METRICS_DISABLED", "true")
        settings = replace(Settings.from_env(), aws_endpoint_url=aws_endpoint_url)
        catalog_json = local_catalog(repo_root() / "infra" / "catalog.json", upstream_url)
        try:
            dynamodb, ssm = aws_clients(settings)
            created = provision(settings, catalog_json=catalog_json, dynamodb=dynamodb, ssm=ssm, replace_catalog=True)
            for line in created:
                print(f"kiln dev: {line}", file=sys.stderr)
            secret, management = _demo_keys(settings)
        except (BotoCoreError, ClientError, PynamoDBException) as exc:  # an endpoint that cannot be used
            raise SystemExit(f"kiln dev: the AWS endpoint {aws_endpoint_url} could not be used: "
                             f"{str(exc) or type(exc).__name__}") from None

        exports = {
            **settings.to_env(),
            "AWS_ENDPOINT_URL": aws_endpoint_url,
            "AWS_DEFAULT_REGION": settings.region,
            "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            "KILN_API_KEY": secret,
            "KILN_MANAGEMENT_KEY": management,  # manages the demo org's keys (/v1/keys), calls no model
            "KILN_BASE_URL": base_url(host, port),
            "KILN_UPSTREAM_URL": upstream_url,
        }
        os.environ.update(exports)
        written = _print_exports(exports)

        from .app import combined_app

        def announce() -> None:
            print(
                f"kiln dev: ready on {exports['KILN_BASE_URL']} (org {DEMO_ORG}, {DEMO_CONCURRENCY} in flight, "
                f"${DEMO_CREDITS} credits); Ctrl-C stops everything",
                flush=True,
            )
            print(
                "kiln dev: try  curl $KILN_BASE_URL/chat/completions -H \"Authorization: Bearer $KILN_API_KEY\" "
                "-H 'Content-Type: application/json' "
                "-d '{\"model\": \"qwen3-32b\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'",
                file=sys.stderr,
                flush=True,
            )

        serve(combined_app(), sock, on_ready=announce)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        # a second Ctrl-C or SIGTERM while the children stop must not cut the clean-up short
        for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop_signal, signal.SIG_IGN)
        stop_children()
        if sock is not None:
            sock.close()
        if written is not None:
            _forget_exports(written)


def local_catalog(path: Path, upstream_url: str) -> str:
    """The catalog file with every model served by one local OpenAI-compatible server."""
    document = json.loads(path.read_text())
    for model in document["models"]:
        model["backends"] = [{"name": "local", "url": upstream_url.rstrip("/")}]
    Catalog.from_document(document)  # fail here, loudly, rather than on the first request
    return json.dumps(document)


def _demo_keys(settings: Any) -> tuple[str, str]:
    """The demo org's fresh inference key and management key (contract §10)."""
    from kiln.store import RecordExists, bind
    from kiln.store.keys import create_key
    from kiln.store.orgs import create_org

    tables = bind(settings)
    try:
        create_org(tables, DEMO_ORG, concurrency=DEMO_CONCURRENCY, credits=DEMO_CREDITS)
    except RecordExists:
        pass
    inference = create_key(tables, DEMO_ORG, label="kiln dev").secret
    return inference, create_key(tables, DEMO_ORG, label="kiln dev (management)", role="management").secret


def base_url(host: str, port: int) -> str:
    """Where clients call the gateway served on host:port: a wildcard address is called on
    loopback, and an IPv6 address in brackets, as a URL holds it."""
    shown = host.removeprefix("[").removesuffix("]")
    shown = "127.0.0.1" if shown in ("0.0.0.0", "::") else shown
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"


DEV_ENV = Path(".kiln") / "dev.env"


def _print_exports(exports: dict[str, str]) -> str:
    """Print the exports and write them to .kiln/dev.env; what was written."""
    written = "\n".join(f"export {name}={_quote(value)}" for name, value in exports.items()) + "\n"
    try:
        DEV_ENV.parent.mkdir(exist_ok=True)
        DEV_ENV.write_text(written)
    except OSError:
        pass
    print(written, end="", flush=True)
    return written


def _forget_exports(written: str) -> None:
    """Remove .kiln/dev.env if it still holds this stack's exports (not a later kiln dev's)."""
    try:
        if DEV_ENV.read_text() == written:
            DEV_ENV.unlink()
    except OSError:
        pass


def _quote(value: str) -> str:
    return shlex.quote(value)
