"""Request normalization and validation, contract §3, before any slot or upstream call.

What is common to every model endpoint is here (the model, `stream`); what one endpoint
checks besides is its rules' (`kiln.apis`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .apis import ModelApi
from .apis.base import stream_flag
from .catalog import Catalog, ModelEntry
from .errors import GatewayError, InvalidJson, MissingParameter, ModelNotFound

__all__ = ["ModelCall", "normalize"]


@dataclass(frozen=True)
class ModelCall:
    """A validated request, ready to be forwarded."""

    api: ModelApi
    model: ModelEntry
    stream: bool
    # whether the client itself asked for the usage chunk (we always ask upstream)
    client_wants_usage: bool
    body: dict[str, Any]


def normalize(api: ModelApi, body: Any, catalog: Catalog | GatewayError,
              allowed: Callable[[str], bool] | None = None) -> ModelCall:
    """Validate in the contract's order (§2 step 4), then build the body to forward; `catalog`
    may be the error its read met, answered when the model is to be looked up.

    missing model → the endpoint's checks that come first (chat: empty messages) → unknown
    model → the endpoint's other checks (tool descriptions, capabilities, field types) →
    `stream`. Unknown fields are forwarded untouched. A model that `allowed` refuses (the
    key's allowlist, contract §10) is not found, exactly as one missing from the catalog.
    """
    if not isinstance(body, dict):
        raise InvalidJson("The request body must be a JSON object.")
    model_id = body.get("model")
    if not isinstance(model_id, str):
        raise MissingParameter("You must provide a model parameter (a string).", param="model")
    api.check_before_model(body)
    if isinstance(catalog, GatewayError):
        raise catalog
    model = catalog.get(model_id)
    if model is None or (allowed is not None and not allowed(model_id)):
        raise ModelNotFound(model_id)
    api.check(body, model)
    stream = stream_flag(body["stream"]) if "stream" in body else False
    forwarded, client_wants_usage = api.forward(body, stream)
    return ModelCall(api, model, stream, client_wants_usage, forwarded)
