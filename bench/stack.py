"""The system under test: embedded AWS, mock upstreams, provisioning, and Kiln's functions.

- `kiln emulator` (the serialized embedded AWS: moto for DynamoDB/SSM) in its own process;
- `kiln mock-upstream` (instant: no delay between tokens) in its own process; the chunk-gap
  scenario reaches the same server through its `/x/token_delay_ms=20,…/v1` path prefix;
- tables, parameters and the catalog (in SSM, as deployed) from template.yaml and
  infra/catalog.json; an org `bench` with a concurrency limit of 64 and a key with every
  limit of its own set (contract §10: concurrency, a monthly spend limit, an allowlist), so
  that every admission and settle carries the key's conditions and bookkeeping;
- Kiln's chat/completions function started by the real functions/run.sh, as the Lambda Web
  Adapter starts it (AWS_LWA_PORT, LAMBDA_TASK_ROOT, `python` on PATH: the project venv's);
- on demand, the storage stand-in (bench/standin.py: a fixed service time, no lock), seeded
  from the embedded AWS, for the cells that must measure the gateway rather than the emulator.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path

from .procs import Child, Procs, free_port, wait_http

__all__ = ["GAP_MODEL", "LONG_MODEL", "MODEL", "Stack", "clean_env"]

ROOT = Path(__file__).resolve().parents[1]
MODEL = "gpt-oss-120b"
GAP_MODEL = "bench-gaps"
GAP_TOKENS = 60
GAP_DELAY_MS = 20
# the long stream of the Lambda sizes: a token every 100 ms, 300 tokens (30 s; max_tokens cuts it shorter)
LONG_MODEL = "bench-long"
LONG_DELAY_MS = 100
LONG_TOKENS = 300
ORG = "bench"
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # nothing of the developer's own AWS set-up may leak into the bench
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def clean_env(**extra: str) -> dict[str, str]:
    """A minimal environment for children: no proxies, no AWS profile, loopback only."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "PYENV_ROOT")
    env = {key: os.environ[key] for key in keep if key in os.environ}
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra)
    return env


@dataclass
class Stack:
    procs: Procs
    python: str = sys.executable
    aws_url: str = ""
    mock_url: str = ""  # http://127.0.0.1:P (no /v1)
    key: str = ""
    settings_env: dict | None = None
    standins: dict = field(default_factory=dict)  # name → Child of each storage stand-in started

    @property
    def standin(self) -> Child:
        return self.standins["standin"]

    @property
    def gap_base(self) -> str:
        return f"{self.mock_url}/x/token_delay_ms={GAP_DELAY_MS},tokens={GAP_TOKENS}/v1"

    def _kiln(self, name: str, *args: str) -> Child:
        return self.procs.start(name, [self.python, "-m", "kiln_ops.cli", *args], env=clean_env(**FAKE_AWS), cwd=ROOT)

    def start(self) -> None:
        aws_port, mock_port = free_port(), free_port()
        self.emulator = self._kiln("emulator", "emulator", "--host", "127.0.0.1", "--port", str(aws_port))
        self.aws_url = f"http://127.0.0.1:{aws_port}"
        wait_http(self.aws_url, child=self.emulator)
        self.mock = self._kiln("mock-upstream", "mock-upstream", "--host", "127.0.0.1", "--port", str(mock_port))
        self.mock_url = f"http://127.0.0.1:{mock_port}"
        wait_http(f"{self.mock_url}/mock/stats", child=self.mock)
        self._provision()

    def catalog_json(self) -> str:
        from kiln_ops.dev import local_catalog

        document = json.loads(local_catalog(ROOT / "infra" / "catalog.json", f"{self.mock_url}/v1"))
        base = next(model for model in document["models"] if model["id"] == MODEL)
        gaps = {**json.loads(json.dumps(base)), "id": GAP_MODEL}
        gaps["backends"] = [{"name": "local-gaps", "url": self.gap_base}]
        document["models"].append(gaps)
        long = {**json.loads(json.dumps(base)), "id": LONG_MODEL}
        long["backends"] = [{"name": "local-long",
                             "url": f"{self.mock_url}/x/token_delay_ms={LONG_DELAY_MS},tokens={LONG_TOKENS}/v1"}]
        document["models"].append(long)
        return json.dumps(document)

    def _provision(self) -> None:
        os.environ.update(FAKE_AWS)
        from kiln.settings import Settings
        from kiln.store import bind
        from kiln.store.keys import create_key
        from kiln.store.orgs import create_org
        from kiln_ops.provision import aws_clients, provision

        settings = replace(Settings.from_env({}), aws_endpoint_url=self.aws_url)
        dynamodb, ssm = aws_clients(settings)
        provision(settings, catalog_json=self.catalog_json(), dynamodb=dynamodb, ssm=ssm, replace_catalog=True)
        tables = bind(settings)
        create_org(tables, ORG, concurrency=64, credits=Decimal("100000"))
        catalog = json.loads(self.catalog_json())
        self.key = create_key(tables, ORG, label="bench", concurrency=64, spend_limit=Decimal("100000"),
                              spend_period="month", models=[model["id"] for model in catalog["models"]]).secret
        self.settings_env = settings.to_env()
        self._clients = (dynamodb, ssm)

    def start_standin(self, service_ms: float, name: str = "standin") -> str:
        """A storage stand-in with the embedded AWS's tables and parameters as they are now; its URL.
        Each is `self.standins[name]`; the bench's own ("standin") is also `self.standin`."""
        from .standin import seed_from

        seed = self.procs.log_dir / f"{name}-seed.json"
        seed.write_text(json.dumps(seed_from(*self._clients)))
        port = free_port()
        child = self.procs.start(
            name, [self.python, "-m", "bench.standin", "--port", str(port), "--service-ms", str(service_ms),
                   "--seed", str(seed)], env=clean_env(), cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/__standin/stats", child=child, ok=lambda status: status == 200)
        self.standins[name] = child
        return url

    def start_floor(self, name: str, *, storage_calls: int = 0, storage_url: str = "") -> tuple[Child, str]:
        """bench/floor.py served by the real functions/run.sh, as a function is: the exchanges of a
        request (`storage_calls` GetItems of the org to the stand-in at `storage_url`, one upstream
        call to the mock; the spaced-token one under bench.floor.GAPS_PREFIX) and nothing else. Its URL."""
        from kiln.settings import Settings
        from kiln.store.schema import ORG as ORG_ITEM

        port = free_port()
        task_root = ROOT / "bench" / "floor_root"
        orgs_table = Settings.from_env(self.settings_env or {}).orgs_table
        env = self.function_env(
            port, task_root, pythonpath=str(ROOT), FLOOR_UPSTREAM=f"{self.mock_url}/v1/chat/completions",
            FLOOR_GAP_UPSTREAM=f"{self.gap_base}/chat/completions",
            FLOOR_STORAGE=storage_url, FLOOR_STORAGE_CALLS=str(storage_calls),
            FLOOR_STORAGE_BODY=json.dumps({"TableName": orgs_table, "Key": {ORG_ITEM.hash_key: {"S": ORG}},
                                           "ConsistentRead": True}))
        child = self.procs.start(name, ["sh", str(ROOT / "functions" / "run.sh")], env=env, cwd=task_root)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", child=child, ok=lambda status: status == 200)
        return child, url

    def function_env(self, port: int, task_root: Path, *, python_dir: str | None = None, pythonpath: str | None = None,
                     **extra: str) -> dict[str, str]:
        """What the Lambda runtime + Web Adapter give run.sh (template.yaml's variables, an emulator)."""
        env = clean_env(**{**FAKE_AWS, **(self.settings_env or {})})
        env["PATH"] = f"{python_dir or Path(self.python).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        env.update(
            AWS_LWA_PORT=str(port),
            LAMBDA_TASK_ROOT=str(task_root),
            POWERTOOLS_SERVICE_NAME="kiln",
            POWERTOOLS_METRICS_NAMESPACE="Kiln",
        )
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        env.update(extra)
        return env

    def start_function_at(self, name: str, tree: Path, function: str = "chat_completions", *,
                          call_count: Path | None = None) -> tuple[Child, str]:
        """One function of another copy of the gateway (`tree` holds its layers/ and functions/), with
        the project venv's python: its layer comes first on PYTHONPATH, ahead of the venv's kiln.
        `call_count`: the file where the bench's instrument writes the calls counted between
        SIGUSR1 and SIGUSR2 (bench/instrument/sitecustomize.py)."""
        port = free_port()
        task_root = tree / "functions" / function
        pythonpath = str(tree / "layers" / "gateway")
        extra = {}
        if call_count is not None:
            pythonpath += f":{ROOT / 'bench' / 'instrument'}"
            extra["BENCH_CALL_COUNT"] = str(call_count)
        env = self.function_env(port, task_root, pythonpath=pythonpath, **extra)
        child = self.procs.start(name, ["sh", str(tree / "functions" / "run.sh")], env=env, cwd=task_root)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", child=child, ok=lambda status: status == 200)
        return child, url

    def start_function(self, name: str, function: str = "chat_completions", *, probe: bool = False,
                       aws_url: str | None = None) -> tuple[Child, str]:
        """One function served by the real functions/run.sh with the project venv's python (its storage
        at `aws_url`: the stand-in, or by default the embedded AWS)."""
        port = free_port()
        extra = {"BENCH_PROBE": "1"} if probe else {}
        if aws_url:
            extra["KILN_AWS_ENDPOINT_URL"] = aws_url
        pythonpath = str(ROOT / "bench" / "instrument") if probe else None
        env = self.function_env(port, ROOT / "functions" / function, pythonpath=pythonpath, **extra)
        child = self.procs.start(name, ["sh", str(ROOT / "functions" / "run.sh")], env=env, cwd=ROOT / "functions" / function)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", child=child, ok=lambda status: status == 200)
        return child, url
