# The chat page's Python example, streamed: once without usage, once with include_usage.
import os

from openai import OpenAI

client = OpenAI(
    base_url="https://api.bricksum.com/v1",
    api_key=os.environ["KILN_API_KEY"],
)

for include_usage in (False, True):
    stream = client.chat.completions.create(
        model="qwen3-32b",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello!"},
        ],
        max_tokens=800,
        stream=True,
        stream_options={"include_usage": include_usage},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    print(text)
    print(usage)
