"""Session-wide embedded AWS and mock model server; a fresh stack (own tables) per test."""

from __future__ import annotations

import os
import re

import pytest

# The embedded AWS accepts any credentials; never let a test reach a real account.
os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
    os.environ.pop(name, None)

from kiln_ops.emulator import EmbeddedAws  # noqa: E402
from kiln_ops.mock_upstream import MockUpstream  # noqa: E402
from kiln_ops.serve import ServerThread  # noqa: E402
from support import TELEMETRY, EmulatorProcess, MockHandle, Stack, make_stack, stacks_on  # noqa: E402

# The suite against a real model server runs only through `make e2e-real`, which sets this.
collect_ignore_glob = [] if os.environ.get("KILN_E2E_BASE_URL") else ["e2e_real/*"]

KEY_SHAPE = re.compile(r"sk-kiln-[A-Za-z0-9_-]{20,}")
# Text that tests send as prompts, or that the mock sends back as completions.
PROMPT_AND_COMPLETION_TEXT = ("Answer briefly.", "The capital of France is", "What is this?", "Paris, a city", "How can I help")


@pytest.fixture(scope="session", autouse=True)
def no_secret_or_prompt_in_telemetry():
    """Logs and metrics written during the whole suite hold no API key and no prompt text."""
    yield
    text = TELEMETRY.text()
    assert not KEY_SHAPE.search(text), "an API key was logged"
    for phrase in PROMPT_AND_COMPLETION_TEXT:
        assert phrase not in text, f"prompt or completion text was logged: {phrase!r}"


@pytest.fixture(scope="session")
def aws():
    """The embedded AWS in its own process, as `kiln dev` runs it."""
    emulator = EmulatorProcess()
    yield emulator
    emulator.stop()


@pytest.fixture(scope="session")
def inprocess_aws():
    """The embedded AWS in this process, for tests that look inside it."""
    emulator = EmbeddedAws().start()
    yield emulator
    emulator.stop()


@pytest.fixture(scope="session")
def mock():
    app = MockUpstream()
    server = ServerThread(app).start()
    yield MockHandle(f"{server.url}/v1", app)
    server.stop()


@pytest.fixture
def stack_factory(aws, mock):
    """make(**settings overrides) → a running Stack; all are torn down after the test."""
    yield from stacks_on(aws.url, mock)


@pytest.fixture(scope="module")
def shared_stack(aws, mock):
    stack = make_stack(aws.url, mock)
    yield stack
    stack.close()


@pytest.fixture
def stack(shared_stack, mock) -> Stack:
    """A stack with the default settings, shared by a module's tests (each makes its own orgs)."""
    mock.wait_for(lambda stats: stats["in_flight"] <= 0, timeout=10)  # the last test's requests are over
    mock.reset()
    yield shared_stack
    if shared_stack.maintenance_changed:
        shared_stack.set_maintenance({"enabled": False})
        shared_stack.maintenance_changed = False


@pytest.fixture
def org(stack) -> tuple[str, str]:
    """A default org (limit 8, $10) and its key."""
    return stack.org()
