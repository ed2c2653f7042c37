"""The bench's probe (bench/instrument/sitecustomize.py) wraps the gateway's own calls; a
wrapper that does not take what its original takes fails every call it sees. One that
lacked AwsClient.call's `resend_unanswered` made every storage call of the probed gateway a
TypeError: the stand-in's cells measured nothing but 503s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import inspect, json
import uvicorn.config
import kiln.aws, kiln.http1, kiln.auth
originals = {"AwsClient.call": kiln.aws.AwsClient.call, "HttpClient.request": kiln.http1.HttpClient.request}
async def app(scope, receive, send):
    pass
config = uvicorn.config.Config(app=app, lifespan="off", log_level="error")
config.load()  # the probe patches kiln here, as when uvicorn loads the gateway
patched = {"AwsClient.call": kiln.aws.AwsClient.call, "HttpClient.request": kiln.http1.HttpClient.request}
out = {}
for name, original in originals.items():
    wrapper = inspect.signature(patched[name])
    missing = []
    for parameter in inspect.signature(original).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        takes = parameter.name in wrapper.parameters or any(
            p.kind == p.VAR_KEYWORD for p in wrapper.parameters.values())
        if not takes:
            missing.append(parameter.name)
    out[name] = {"wrapped": patched[name] is not original, "missing": missing}
print(json.dumps(out))
"""


def test_every_wrapper_of_the_probe_takes_what_its_original_takes():
    env = {**os.environ, "BENCH_PROBE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "instrument"), str(ROOT / "layers" / "gateway")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "bench probe:" not in done.stdout + done.stderr, done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {name: {"wrapped": True, "missing": []} for name in ("AwsClient.call", "HttpClient.request")}
