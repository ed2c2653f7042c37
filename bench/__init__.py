"""Kiln's benchmark harness: `make bench` (or `.venv/bin/python -m bench`).

Measures the gateway against the same mock upstream directly, through Kiln (served as the
Lambda Web Adapter serves it, over the serialized embedded AWS), through the LiteLLM proxy
and through Portkey; then where Kiln's time goes, streaming gaps, cold starts and memory.
Writes bench/results/<timestamp>.json (+ latest.json), docs/performance/*.png and
docs/performance.md. See docs/performance.md for how to read it.
"""
