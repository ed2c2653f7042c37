"""Contract §1: GET /v1/models and /v1/models/{id}: the catalog, priced per token."""

from __future__ import annotations

import copy

import pytest

from support import catalog_for_tests


def test_list_models_shows_the_catalog_with_pricing_and_context_length(stack, org):
    response = stack.http.get("/v1/models", headers={"Authorization": f"Bearer {org[1]}"})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    models = {m["id"]: m for m in body["data"]}
    assert {"qwen3-32b", "gpt-oss-120b"} <= set(models)
    oss = models["gpt-oss-120b"]
    assert {"id", "object", "created", "owned_by", "context_length", "pricing"} <= set(oss)
    assert oss["object"] == "model" and oss["context_length"] == 131072
    # $0.035 / $0.07 per million → per token
    assert oss["pricing"] == {"prompt": "0.000000035", "completion": "0.00000007", "cached": "0.0000000175"}
    assert oss["capabilities"]["ignore_eos"] is False
    assert models["qwen3-32b"]["capabilities"]["forced_tool_choice"] is False
    assert "backends" not in oss and "127.0.0.1" not in response.text  # no backend URLs leak


def test_retrieve_one_model(stack, org):
    response = stack.http.get("/v1/models/qwen3-32b", headers={"Authorization": f"Bearer {org[1]}"})
    assert response.status_code == 200
    assert response.json()["id"] == "qwen3-32b"


@pytest.mark.parametrize("path", ["/v1/models/Qwen/Qwen3-32B", "/v1/models/Qwen%2FQwen3-32B"], ids=["slash", "encoded"])
def test_retrieve_a_model_whose_id_holds_a_slash(stack_factory, mock, path):
    """vLLM serves a model under its Hugging Face name by default; the SDK's
    `models.retrieve("Qwen/Qwen3-32B")` sends the slash as it is, or encoded."""
    catalog = catalog_for_tests(mock.url)
    catalog["models"].append({**copy.deepcopy(catalog["models"][0]), "id": "Qwen/Qwen3-32B"})
    stack = stack_factory(catalog=catalog)
    _, key = stack.org()
    response = stack.http.get(path, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "Qwen/Qwen3-32B"
    missing = stack.http.get("/v1/models/Qwen/Qwen3-33B", headers={"Authorization": f"Bearer {key}"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


@pytest.mark.parametrize("path", ["/v1/models/", "/v1/models/qwen3-32b/", "/v1/models//qwen3-32b"])
def test_a_model_path_with_an_empty_part_or_a_trailing_slash_is_an_unknown_url(stack, org, path):
    """As API Gateway matches `{model_id+}`: no empty id, none with a slash at either end."""
    response = stack.http.get(path, headers={"Authorization": f"Bearer {org[1]}"})
    assert (response.status_code, response.json()["error"]["code"]) == (404, "unknown_url")


def test_retrieve_an_unknown_model_is_404_model_not_found(stack, org):
    response = stack.http.get("/v1/models/not-a-model", headers={"Authorization": f"Bearer {org[1]}"})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `not-a-model` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_models_need_a_key_and_write_no_usage(stack, org):
    assert stack.http.get("/v1/models").status_code == 401
    response = stack.http.get("/v1/models", headers={"Authorization": f"Bearer {org[1]}"})
    assert "X-Neocloud-Generation-Id" not in response.headers
    assert stack.events(org[0]) == []
