# The completions page's Python example, streamed with include_usage.
import os

from openai import OpenAI

client = OpenAI(
    base_url="https://api.bricksum.com/v1",
    api_key=os.environ["KILN_API_KEY"],
)

stream = client.completions.create(
    model="qwen3-32b",
    prompt="The capital of France is",
    max_tokens=32,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].text, end="")
    if chunk.usage:
        print()
        print(chunk.usage)
