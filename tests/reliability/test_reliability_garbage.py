"""A request's objects are freed when it ends, not left in reference cycles for the collector.

Objects in a cycle outlive their request until Python's cycle collector finds them, and its
passes, which grow with what is left, are CPU every request pays. None of the gateway's own
objects may be left that way by a request that went well, buffered or streamed."""

from __future__ import annotations

import gc
import time
from collections import Counter

CHAT = "/v1/chat/completions"


def _gateways_own(objects: list) -> Counter:
    return Counter(type(o).__qualname__ for o in objects
                   if type(o).__module__ == "kiln" or type(o).__module__.startswith("kiln."))


def test_a_request_leaves_nothing_for_the_cycle_collector(stack, org):
    _, key = org
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
            "stream_options": {"include_usage": True}}
    for stream in (False, True):  # the caches and connections a first request fills
        assert stack.post(CHAT, {**body, "stream": stream}, key).status_code == 200
    time.sleep(0.2)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage, for counting
    try:
        for stream in (False, True, False, True):
            response = stack.post(CHAT, {**body, "stream": stream}, key)
            assert response.status_code == 200
            assert ("data: [DONE]" in response.text) if stream else response.json()["usage"]["cost"] > 0
        time.sleep(0.2)  # the settles' and the key's bookkeeping tasks are over
        gc.collect()
        left = _gateways_own(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == Counter()
