# The pages' documented errors through the Python SDK: one line per case, "<exception> <status> <code>".
import os

import openai
from openai import OpenAI

client = OpenAI(
    base_url="https://api.bricksum.com/v1",
    api_key=os.environ["KILN_API_KEY"],
    max_retries=0,
)
cases = {
    "model_not_found": lambda: client.completions.create(model="not-a-model", prompt="The capital of France is", max_tokens=32),
    "empty_array": lambda: client.chat.completions.create(model="qwen3-32b", messages=[], max_tokens=800),
    "unsupported_parameter": lambda: client.chat.completions.create(
        model="gpt-oss-120b", messages=[{"role": "user", "content": "Hello!"}], extra_body={"ignore_eos": True}
    ),
    "invalid_api_key": lambda: OpenAI(base_url=client.base_url, api_key="sk-kiln-wrong", max_retries=0).models.list(),
}
for name, call in cases.items():
    try:
        call()
        print(name, "no error")
    except openai.APIStatusError as error:
        print(name, type(error).__name__, error.status_code, error.code)
