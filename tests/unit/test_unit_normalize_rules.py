"""kiln.normalize: the messages a client reads for the checks common to every endpoint."""

import json

import pytest

from kiln.apis.chat import API as CHAT
from kiln.apis.completions import API as COMPLETIONS
from kiln.apis.responses import API as RESPONSES
from kiln.catalog import Catalog
from kiln.errors import GatewayError
from kiln.normalize import normalize

CATALOG = Catalog.from_document({"models": [{"id": "m", "context_length": 4096, "pricing": {"input": "1", "output": "1"}}]})


def error_of(endpoint, body):
    with pytest.raises(GatewayError) as info:
        normalize(endpoint, body, CATALOG)
    return info.value.status, json.loads(info.value.body())["error"]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_a_body_that_is_no_object_is_told_so(endpoint, body):
    assert error_of(endpoint, body) == (
        400,
        {"message": "The request body must be a JSON object.", "type": "invalid_request_error", "param": None, "code": "invalid_json"},
    )


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("model", [None, 7, ["m"]])
def test_a_missing_model_is_told_to_send_a_string(endpoint, model):
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi"}
    if model is not None:
        body["model"] = model
    assert error_of(endpoint, body) == (
        400,
        {
            "message": "You must provide a model parameter (a string).",
            "type": "invalid_request_error",
            "param": "model",
            "code": "missing_required_parameter",
        },
    )
