#!/bin/sh
# Started by the Lambda Web Adapter (AWS_LAMBDA_EXEC_WRAPPER=/opt/bootstrap, Handler: run.sh)
# in streaming mode: serves this function's app on the adapter's port. The adapter waits
# until /healthz answers, then relays each invocation as HTTP and streams the response.
export PYTHONPATH="/opt/python:${LAMBDA_TASK_ROOT:-.}${PYTHONPATH:+:$PYTHONPATH}"
# --no-proxy-headers: the gateway reads no client address or scheme, and the adapter is its only client
exec python -m uvicorn --host 127.0.0.1 --port "${AWS_LWA_PORT:-8080}" \
    --no-access-log --log-level warning --timeout-keep-alive 75 --no-proxy-headers app:app
