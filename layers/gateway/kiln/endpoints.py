"""Every public endpoint of the gateway, declared once.

Each entry names its routes, the function that serves them (`functions/<function>/app.py`,
`<Resource>Function` in template.yaml) and, for a model endpoint, its rules (`kiln.apis`):
validation, metering, streaming. The functions' apps, the local stack, the template and
sam-local checks, the tests and the bench all read this list. A new endpoint is its rules
module, one entry here, its function's app and its template block.
"""

from __future__ import annotations

from .apis import ModelApi
from .apis.chat import API as CHAT_API
from .apis.completions import API as COMPLETIONS_API
from .apis.responses import API as RESPONSES_API

__all__ = ["CHAT", "COMPLETIONS", "ENDPOINTS", "GENERATIONS", "MODELS", "RESPONSES", "Endpoint", "Route", "by_function"]


class Route:
    """One method and path. `name` is the route's name in the app's OpenAPI schema."""

    __slots__ = ("method", "path", "name", "summary")

    def __init__(self, method: str, path: str, name: str, summary: str) -> None:
        self.method, self.path, self.name, self.summary = method, path, name, summary


class Endpoint:
    """The routes one function serves; `api` is set for a model endpoint (admitted, metered)."""

    __slots__ = ("function", "routes", "api", "streaming")

    def __init__(self, function: str, routes: tuple[Route, ...], *, api: ModelApi | None = None,
                 streaming: bool = False) -> None:
        self.function = function
        self.routes = routes
        self.api = api
        # served through the Lambda Web Adapter with response streaming (else Mangum, buffered)
        self.streaming = streaming

    @property
    def resource(self) -> str:
        """Its function's logical id in template.yaml: chat_completions → ChatCompletionsFunction."""
        return "".join(part.capitalize() for part in self.function.split("_")) + "Function"


CHAT = Endpoint(
    "chat_completions",
    (Route("POST", "/v1/chat/completions", "chat.completions", "Create a chat completion"),),
    api=CHAT_API,
    streaming=True,
)
COMPLETIONS = Endpoint(
    "completions",
    (Route("POST", "/v1/completions", "completions", "Create a text completion"),),
    api=COMPLETIONS_API,
    streaming=True,
)
RESPONSES = Endpoint(
    "responses",
    (Route("POST", "/v1/responses", "responses", "Create a model response (the Responses API)"),),
    api=RESPONSES_API,
    streaming=True,
)
MODELS = Endpoint(
    "models",
    (
        Route("GET", "/v1/models", "models.list", "List the models in the catalog"),
        # greedy (API Gateway's `+`): a model id may hold slashes, as vLLM's Hugging Face names do
        Route("GET", "/v1/models/{model_id+}", "models.retrieve", "One model of the catalog"),
    ),
)
# the generations function also serves an org's self-service (contract §10, kiln.selfservice)
GENERATIONS = Endpoint(
    "generations",
    (
        Route("GET", "/v1/generations/{gen_id}", "generations.retrieve", "One of your usage events"),
        Route("GET", "/v1/credits", "credits.retrieve", "Your organization's credits"),
        Route("GET", "/v1/key", "key.retrieve", "The key you call with: its limits and spend"),
        Route("GET", "/v1/usage", "usage.retrieve", "Your organization's usage, summed by day, model or key"),
        Route("POST", "/v1/keys", "keys.create", "Create a key (management keys)"),
        Route("GET", "/v1/keys", "keys.list", "Your organization's keys (management keys)"),
        Route("GET", "/v1/keys/{key_id}", "keys.retrieve", "One key (management keys)"),
        Route("PATCH", "/v1/keys/{key_id}", "keys.update", "Change a key's attributes (management keys)"),
        Route("DELETE", "/v1/keys/{key_id}", "keys.delete", "Revoke a key (management keys)"),
    ),
)

ENDPOINTS: tuple[Endpoint, ...] = (CHAT, COMPLETIONS, RESPONSES, MODELS, GENERATIONS)


def by_function(function: str) -> Endpoint:
    for endpoint in ENDPOINTS:
        if endpoint.function == function:
            return endpoint
    raise KeyError(function)
