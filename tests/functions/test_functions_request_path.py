"""What a function process loads to serve a request: the layer ships no AWS SDK (botocore,
boto3) and no pynamodb (operators' tools use them), so serving must never import them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SERVE_ONE = r"""
import asyncio, json, sys
import httpx
from kiln_functions.chat_completions.app import app

async def main():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://function") as client:
        response = await client.post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]},
                                     headers={"Authorization": "Bearer " + sys.argv[1]})
    # (Powertools tries a bare `import botocore` for its user agent; the SDK's machinery is what costs)
    heavy = sorted(set(sys.modules) & {"botocore.session", "botocore.client", "boto3", "pynamodb", "s3transfer", "httpcore"})
    print(json.dumps({"status": response.status_code, "heavy": heavy}))

asyncio.run(main())
"""


def test_serving_a_request_imports_no_aws_sdk(stack):
    _, key = stack.org()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_")}, **stack.settings.to_env(),
           "POWERTOOLS_METRICS_DISABLED": "true"}
    done = subprocess.run([sys.executable, "-c", SERVE_ONE, key], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome == {"status": 200, "heavy": []}
