"""kiln.lax: request values read as vLLM's pydantic request models read them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from kiln.lax import server_bool, server_int

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["4", " 4 ", "4.0", "+4", "4_000", "yes", "On", "t", "0", "1.0"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=5,
)


def _pydantic(kind: type, value: object) -> object:
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError:
        return None


@given(JSON)
def test_an_integer_is_read_as_pydantic_reads_it(value):
    assert server_int(value) == _pydantic(int, value)


@given(JSON)
def test_a_boolean_is_read_as_pydantic_reads_it(value):
    read = server_bool(value)
    assert read == _pydantic(bool, value) and (read is None or type(read) is bool)


@pytest.mark.parametrize("value, read", [("4", 4), (4.0, 4), (" 4 ", 4), (4.5, None), ("four", None), ([4], None)])
def test_spellings_of_a_count(value, read):
    assert server_int(value) == read


@pytest.mark.parametrize("value, read", [(1, True), ("yes", True), ("True", True), ("off", False), (2, None)])
def test_spellings_of_a_switch(value, read):
    assert server_bool(value) is read


def test_exact_values_are_read_without_importing_the_validator():
    """A cold start pays for pydantic-core only when a request spells a value oddly."""
    code = ("import sys; from kiln.lax import server_bool, server_int; "
            "assert (server_int(4), server_bool(True), server_int(None)) == (4, True, None); "
            "print('pydantic_core' in sys.modules); server_int('4'); print('pydantic_core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
