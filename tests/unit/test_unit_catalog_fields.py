"""kiln.catalog: the /v1/models object field by field, defaults, and the messages of a bad catalog."""

import copy
import re

import pytest

from kiln.catalog import Backend, Catalog, CatalogError, Limits

MODEL = {"id": "m", "context_length": 8192, "pricing": {"input": "1.5", "output": "3"}}


def one(**changes):
    entry = copy.deepcopy(MODEL)
    entry.update(changes)
    return {"models": [entry]}


def error(document):
    with pytest.raises(CatalogError) as info:
        Catalog.from_document(document)
    return str(info.value)


def test_the_public_model_object_is_exactly_the_contracts():
    entry = one(owned_by="acme", created=1700000000, capabilities={"forced_tool_choice": True, "ignore_eos": False})
    assert Catalog.from_document(entry).get("m").public() == {
        "id": "m",
        "object": "model",
        "created": 1700000000,
        "owned_by": "acme",
        "context_length": 8192,
        "pricing": {"prompt": "0.0000015", "completion": "0.000003"},
        "capabilities": {"forced_tool_choice": True, "json_response_format": False, "ignore_eos": False},
    }


def test_a_model_that_says_little_gets_the_defaults():
    model = Catalog.from_document(one(backends=[{"url": "http://a/v1"}, {"url": "http://b/v1"}])).get("m")
    assert (model.owned_by, model.created) == ("kiln", 0)
    assert [backend.name for backend in model.backends] == ["backend-0", "backend-1"]
    assert model.public()["capabilities"] == {"forced_tool_choice": False, "json_response_format": False, "ignore_eos": True}


def test_the_local_stack_names_its_one_backend_local():
    catalog = Catalog.from_document(one()).with_backend_url("http://127.0.0.1:8001/v1")
    assert catalog.get("m").backends == (Backend(name="local", url="http://127.0.0.1:8001/v1"),)


def test_a_backend_url_loses_only_its_trailing_slashes():
    model = Catalog.from_document(one(backends=[{"url": "http://gpu-X//"}, {"url": "https://h/v1X"}])).get("m")
    assert [backend.url for backend in model.backends] == ["http://gpu-X", "https://h/v1X"]


def test_a_limit_of_one_byte_is_a_limit():
    model = Catalog.from_document(one(limits={"event_bytes": 1, "header_bytes": 1, "body_bytes": 1})).get("m")
    assert model.limits == Limits(header_bytes=1, body_bytes=1, event_bytes=1)


@pytest.mark.parametrize(
    "document, message",
    [
        ([], 'catalog must be an object with a "models" array'),
        ({"models": [{"context_length": 1, "pricing": {}}]}, "models[0]: 'id' is required (str)"),
        (one(capabilities={"ignore_eos": "no"}), "model 'm': capabilities.ignore_eos must be true or false"),
        (one(created=-1), "model 'm': created must be a non-negative number"),
        (one(timeouts={"connect": "5"}), "model 'm': timeouts.connect must be a non-negative number"),
        (one(limits={"event_bytes": 0}), "model 'm': limits.event_bytes must be a positive whole number of bytes"),
        (one(backends=[{"url": "ftp://a"}]), "model 'm' backends[0]: url must start with http:// or https://"),
    ],
)
def test_a_bad_catalog_is_told_exactly_what_is_wrong(document, message):
    assert error(document) == message


def test_an_unknown_field_name_is_named_in_the_error_of_a_catalog_being_written():
    with pytest.raises(CatalogError) as info:
        Catalog.from_document(one(capabilities={"colour": True}), written=True)
    assert re.search(r"^model 'm': .*'colour'", str(info.value))
