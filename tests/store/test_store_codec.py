"""The request path's item encoding equals the pynamodb schema's, field for field."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kiln.settings import Settings
from kiln.store import UsageEvent, bind
from kiln.store.codec import from_item, to_item

EVENTS = [
    UsageEvent(gen_id="gen-01", org_id="acme", created_at="2026-11-30T10:00:00.000Z", key_id="key_1", model="m",
               endpoint="chat.completions", streamed=True, status="success", cost=Decimal("0.000000665"),
               http_status=200, prompt_tokens=5, completion_tokens=7, cached_tokens=2, usage_source="upstream",
               finish_reason="stop", ttfb_ms=12, duration_ms=340, upstream="vllm-a", expires_at=1830000000),
    UsageEvent(gen_id="gen-02", org_id="acme", created_at="2026-11-30T10:00:01.000Z", key_id="key_1", model="m",
               endpoint="completions", streamed=False, status="abandoned", cost=Decimal(0),
               error="lease expired before the request settled"),
    UsageEvent(gen_id="gen-03", org_id="acme", created_at="2026-11-30T10:00:02.000Z", key_id="key_1", model="m",
               endpoint="completions", streamed=False, status="success", cost=Decimal("12345678901234.00000000000001")),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.gen_id)
def test_usage_items_encode_as_pynamodb_does(event):
    record = bind(Settings()).usage(**{k: v for k, v in event.as_dict().items() if v is not None})
    assert to_item(event) == record.serialize()


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.gen_id)
def test_usage_items_decode_back_to_the_same_event(event):
    assert UsageEvent.from_item(to_item(event)) == event
    assert from_item(to_item(event))["cost"] == event.cost
