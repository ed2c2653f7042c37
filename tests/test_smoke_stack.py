from support import data_events


def test_buffered_and_streamed_chat(stack, org):
    org_id, key = org
    r = stack.post("/v1/chat/completions", {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}, key)
    assert r.status_code == 200, r.text
    r = stack.post(
        "/v1/chat/completions",
        {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        key,
    )
    assert r.status_code == 200
    assert data_events(r.text)[-1] == "[DONE]"
    assert len(stack.events(org_id)) == 2
