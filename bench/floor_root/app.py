"""The floor (bench/floor.py) as functions/run.sh serves a function: `app:app` in the task root."""

from bench.floor import from_env

app = from_env()
