"""The OpenAI Agents SDK against the gateway, unchanged: one run and one streamed run of an
agent on the gateway's model (its default model API, the Responses API). Prints, as JSON, what
each run said, its usage as the SDK counts it, and the generation ids the gateway answered.

Run from its own environment (.tools/agents, made by `make setup`) by
tests/clients/test_clients_openai_agents.py: KILN_BASE_URL, KILN_API_KEY, KILN_MODEL.
"""

from __future__ import annotations

import asyncio
import json
import os

from agents import Agent, Runner, set_default_openai_client, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient


async def main() -> dict:
    gen_ids: list[str] = []

    async def note(response) -> None:  # the SDK's HTTP client's response
        gen_id = response.headers.get("x-neocloud-generation-id")
        if gen_id:
            gen_ids.append(gen_id)

    http = DefaultAsyncHttpxClient(event_hooks={"response": [note]}, timeout=30)
    set_tracing_disabled(True)  # no traces sent anywhere
    set_default_openai_client(AsyncOpenAI(base_url=os.environ["KILN_BASE_URL"], api_key=os.environ["KILN_API_KEY"],
                                          http_client=http, max_retries=0))
    agent = Agent(name="assistant", instructions="Answer briefly.", model=os.environ["KILN_MODEL"])
    out: dict = {}
    ran = await Runner.run(agent, "Say hello.")
    usage = ran.context_wrapper.usage
    out["run"] = {"text": ran.final_output, "requests": usage.requests, "input_tokens": usage.input_tokens,
                  "output_tokens": usage.output_tokens}
    streamed = Runner.run_streamed(agent, "Say hello.")
    deltas = 0
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and getattr(event.data, "type", "") == "response.output_text.delta":
            deltas += 1
    usage = streamed.context_wrapper.usage
    out["streamed"] = {"text": streamed.final_output, "deltas": deltas, "requests": usage.requests,
                       "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}
    out["gen_ids"] = gen_ids
    await http.aclose()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
