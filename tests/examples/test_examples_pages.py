"""The reference pages' curl, Python and JavaScript examples, verbatim, against the local stack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PAGE_BASE_URL = "https://api.bricksum.com/v1"
JS = HERE / "js"


@pytest.fixture(scope="module")
def node():
    if shutil.which("node") is None or not (JS / "node_modules" / "openai").exists():
        pytest.fail("Node and the pinned openai package are needed: `make test` installs them (npm ci in tests/examples/js)")
    return shutil.which("node")


@pytest.fixture
def run(stack, tmp_path):
    """run(file) → stdout of an example with only the base URL swapped, the key from KILN_API_KEY."""
    _, key = stack.org()
    env = {**os.environ, "KILN_API_KEY": key}

    def run(source: Path, *, replace: tuple[str, str] | None = None, check: bool = True) -> str:
        text = source.read_text().replace(PAGE_BASE_URL, stack.base_url)
        if replace:
            assert replace[0] in text
            text = text.replace(*replace)
        if source.suffix == ".mjs":
            folder = JS / ".run"  # beside node_modules, so `import "openai"` resolves
            folder.mkdir(exist_ok=True)
            command = ["node"]
        else:
            folder = tmp_path
            command = [sys.executable] if source.suffix == ".py" else ["bash"]
        script = folder / f"{tmp_path.name}-{source.name}"
        script.write_text(text)
        try:
            done = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=60)
        finally:
            if source.suffix == ".mjs":
                script.unlink()
        if check:
            assert done.returncode == 0, done.stderr
        return done.stdout

    return run


PAGES = HERE / "pages"
VARIANTS = HERE / "variants"


def test_chat_curl(run):
    answer = json.loads(run(PAGES / "chat.sh"))
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["total_tokens"] == 21 and answer["usage"]["cost"] > 0


def test_completions_curl(run):
    answer = json.loads(run(PAGES / "completions.sh"))
    assert answer["choices"][0]["text"] == " Paris, a city on the Seine."
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (5, 7)


def test_chat_python(run):
    content, usage = run(PAGES / "chat.py").splitlines()
    assert content == "Hello! How can I help you today? Ask me anything."
    assert "prompt_tokens=9" in usage and "completion_tokens=12" in usage and "cost=" in usage


def test_completions_python(run):
    text, usage = run(PAGES / "completions.py").splitlines()
    assert text == " Paris, a city on the Seine."
    assert "prompt_tokens=5" in usage and "completion_tokens=7" in usage and "cost=" in usage


def test_chat_javascript(run, node):
    output = run(PAGES / "chat.mjs")
    assert output.splitlines()[0] == "Hello! How can I help you today? Ask me anything."
    assert "prompt_tokens: 9" in output and "completion_tokens: 12" in output and "cost:" in output


def test_completions_javascript(run, node):
    output = run(PAGES / "completions.mjs")
    assert output.splitlines()[0] == " Paris, a city on the Seine."
    assert "prompt_tokens: 5" in output and "completion_tokens: 7" in output


def test_streamed_variants_python_and_javascript(run, node):
    for script in (VARIANTS / "chat_stream.py", VARIANTS / "chat_stream.mjs"):
        without, no_usage, text, usage = run(script).splitlines()
        assert without == text == "Hello! How can I help you today? Ask me anything."
        assert no_usage in ("None", "null")  # the usage chunk is hidden unless asked for
        assert "12" in usage and "cost" in usage
    for script in (VARIANTS / "completions_stream.py", VARIANTS / "completions_stream.mjs"):
        text, usage = run(script).splitlines()
        assert text == " Paris, a city on the Seine." and "cost" in usage


def test_streamed_curl(run):
    output = run(PAGES / "chat.sh", replace=('"max_tokens": 800', '"max_tokens": 800, "stream": true'))
    events = [line for line in output.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in event for event in events)


def test_the_documented_errors_with_curl_give_the_documented_bodies(run):
    not_found = run(PAGES / "completions.sh", replace=('"model": "qwen3-32b"', '"model": "not-a-model"'))
    assert json.loads(not_found) == json.loads((PAGES / "error-404.json").read_text())
    empty = run(PAGES / "chat.sh", replace=(
        '''[
      {"role": "system", "content": "Answer briefly."},
      {"role": "user", "content": "Hello!"}
    ]''', "[]"))
    assert json.loads(empty) == json.loads((PAGES / "error-400.json").read_text())


EXPECTED_ERRORS = {
    "model_not_found": ("NotFoundError", "404", "model_not_found"),
    "empty_array": ("BadRequestError", "400", "empty_array"),
    "unsupported_parameter": ("BadRequestError", "400", "unsupported_parameter"),
    "invalid_api_key": ("AuthenticationError", "401", "invalid_api_key"),
}


@pytest.mark.parametrize("script", ["errors.py", "errors.mjs"])
def test_each_sdk_raises_the_matching_error_class(run, node, script):
    lines = dict(line.split(" ", 1) for line in run(VARIANTS / script).splitlines())
    assert {name: tuple(rest.split()) for name, rest in lines.items()} == EXPECTED_ERRORS
