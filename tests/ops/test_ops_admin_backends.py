"""`kiln admin backends`: the catalog's backends, and the local gateway's view of their health."""

from __future__ import annotations

import json

from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser


def admin(stack, *argv):
    lines: list[str] = []
    args = build_parser().parse_args(["admin", *argv])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0
    return lines


def test_backends_shows_the_catalog_and_what_the_local_gateway_has_in_service(stack_factory, monkeypatch):
    monkeypatch.delenv("KILN_BASE_URL", raising=False)
    stack = stack_factory(backend_failure_threshold=1, backend_cooldown_seconds=60)
    _, key = stack.org()
    response = stack.post("/v1/chat/completions", {"model": "failover-model", "messages": [{"role": "user", "content": "x"}]}, key)
    assert response.status_code == 200  # "dead" refused, "b" served: dead is out of service
    rows = json.loads("\n".join(admin(stack, "backends", "--gateway", stack.base_url, "--format", "json")))
    by_name = {(row["model"], row["backend"]): row for row in rows}
    dead = by_name[("failover-model", "dead")]
    assert dead["state"] == "out_of_service" and dead["reason"].startswith("a transport failure") and dead["out_for_seconds"] > 0
    assert by_name[("failover-model", "b")]["state"] == "in_service"
    assert by_name[("disabled-backend-model", "off")]["state"] == "disabled"
    assert by_name[("qwen3-32b", "local")]["enabled"] is True


def test_without_a_gateway_to_ask_it_says_where_the_state_is(stack_factory, monkeypatch):
    monkeypatch.delenv("KILN_BASE_URL", raising=False)
    stack = stack_factory()
    lines = admin(stack, "backends")
    assert lines[0].split()[:5] == ["MODEL", "BACKEND", "URL", "ENABLED", "STATE"]
    assert "BackendInService" in lines[-1]
